"""Model families: offline tiny builds for tests, references, and the family registry.

Design: docs/guide/models.md.
"""
