"""Media: sources, fetching and decoding under the media policy.

Design: docs/guide/media.md.
"""
