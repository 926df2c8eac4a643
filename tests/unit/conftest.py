"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest

from shared.engines.transformers_engine import TransformersEngine


@pytest.fixture(scope="module")
async def engines(model_dir):
    """Two transformers engines on the demo model: one generates, the other decodes what the
    first prefilled (the split path), or both serve side by side."""
    a, b = TransformersEngine(model_dir), TransformersEngine(model_dir)
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()
