"""Compute engines: model-family compute paths, sampling and detokenization."""
