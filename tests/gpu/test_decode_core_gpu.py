"""The decode core on CUDA (``pytest -m gpu``): the core process holds the LM on the GPU and must
yield the tokens of the engine's own decode on a thread, in float32 and bfloat16, for requests
decoded one at a time and (float32) together. Skips where torch sees no CUDA GPU."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.engines.decode_core import CoreDecodeEngine
from shared.engines.transformers_engine import TransformersEngine
from tests.unit.test_decode_core import _decode, _prefilled

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA GPU visible to torch: the GPU tests run on a GPU host")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_decode_core_on_cuda_equals_the_thread_engine(model_dir, dtype) -> None:
    thread = TransformersEngine(model_dir, device="cuda", dtype=dtype)
    core = CoreDecodeEngine(model_dir, device="cuda", dtype=dtype)
    await asyncio.gather(thread.start(), core.start())
    try:
        reqs = await _prefilled(thread, 3)
        assert reqs[0][1].kv.device.type == "cuda"
        expected = [[int(t) for t in await _decode(thread, *r)] for r in reqs]
        alone = [[int(t) for t in await _decode(core, *r)] for r in reqs]
        assert alone == expected
        if dtype == "float32":  # batched, in the core and on the thread (float32 keeps the tokens equal);
            for engine in (core, thread):  # a seeded request among them: its logits must reach sampling on the CPU
                together = await asyncio.gather(*(_decode(engine, *r) for r in reqs))
                assert [[int(t) for t in g] for g in together] == expected
        print(f"decode core on {torch.cuda.get_device_name()} ({dtype}): {sum(map(len, expected))} tokens equal; "
              f"{core.forwards} forwards, {core.steps} sequence-steps")
    finally:
        await asyncio.gather(thread.stop(), core.stop())
