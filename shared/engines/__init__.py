"""Compute engines: model-family compute paths, sampling and detokenization.

Design: docs/design/architecture.md.
"""
