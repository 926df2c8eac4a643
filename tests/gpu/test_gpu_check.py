"""The GPU check (loadtest/gpucheck.py) as a test: ``pytest -m gpu`` / ``make gpu-check``. Skips
where torch sees no CUDA GPU (every CI machine), so the CPU suite stays green."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from tests import procs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA GPU visible to torch: the GPU check runs on a GPU host "
                                        "(make gpu-check)")]


def test_epd_on_cuda_equals_generate_and_every_path_moves_bytes(model_dir) -> None:
    """E/P/D in three processes on CUDA (float32 and bf16), over CUDA IPC and over pinned
    staging, equals in-process generate(); the probe moves 1/16/256 MiB intact on every path."""
    r = subprocess.run([sys.executable, "-m", "loadtest.gpucheck", "--model-path", str(model_dir)],
                       cwd=procs.REPO, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "gpu-check: passed" in r.stdout


async def test_cuda_tensor_put_and_local_get_stay_on_the_device() -> None:
    from shared.transfer import TransferAgent

    async with TransferAgent("gpu-local-test", 8 << 20, device="cuda", cuda_ipc=True) as agent:
        t = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
        ref = agent.put(t)
        assert ref.on_device and ref.cuda_ipc is not None and ref.host_shm is not None and ref.mem == "DRAM"
        back = await agent.get(agent.ref(), ref)
        assert back.device.type == "cuda" and back.dtype == torch.bfloat16 and torch.equal(back, t)


async def test_put_returns_before_its_copy_lands_and_every_reader_gets_the_put_bytes() -> None:
    """The device→pinned copy runs behind ``put`` from a private GPU copy: the caller may reuse
    its tensor at once, and a local read (no CUDA IPC copy held) waits for the copy."""
    from shared.transfer import TransferAgent

    async with TransferAgent("gpu-staging-test", 160 << 20, device="cuda", cuda_ipc=False) as agent:
        t = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
        want = t.clone()
        ref = agent.put(t)
        t.zero_()  # the caller's next kernel overwrites its tensor
        assert ref.stamp and ref.chunk_bytes and ref.cuda_ipc is None and ref.host_shm is not None
        back = await agent.get(agent.ref(), ref)
        assert back.device.type == "cuda" and torch.equal(back, want)


async def test_a_shared_pool_pull_is_queued_on_the_stream_and_release_waits_for_it() -> None:
    """A pull from a mapped pinned pool returns with its copy queued on the caller's stream;
    ``release`` waits for that copy, so the owner may overwrite the slot at once after it.
    (CUDA IPC takes the same way in the GPU check: a process cannot open its own handles.)"""
    from shared.transfer import TransferAgent

    async with TransferAgent("gpu-owner", 160 << 20, device="cuda", cuda_ipc=False) as owner, \
            TransferAgent("gpu-reader", 8 << 20, device="cuda", cuda_ipc=False) as reader:
        t = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
        want = t.clone()
        ref = owner.put(t)
        got = await reader.get(owner.ref(), ref)
        assert reader.stats()["shm_gets"] == 1
        await reader.release(owner.ref(), [ref.lease])
        for _ in range(500):  # the release notification frees the slot at the owner
            if owner.stats()["released_leases"]:
                break
            await asyncio.sleep(0.01)
        again = owner.put(torch.zeros_like(t))  # the freed slot, overwritten
        assert again.addr == ref.addr
        owner.free_local(again.lease)
        assert torch.equal(got, want)
