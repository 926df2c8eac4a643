"""TransferAgent against real NIXL (UCX, DRAM) across two processes.

Each test that needs an owner spawns ``tests.transport.owner_proc`` and always kills and
reaps it (try/finally). Timings are printed (run with ``-s`` to see them). The consumers here
turn their shared pool off (``shared_pool=False``), so they pull over NIXL even though their
owner is on this host (test_host_shm.py covers that path).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import msgspec
import pytest
import torch

from shared.transfer import OwnerGoneError, PoolFullError, TransferAgent
from tests.transport.owner_proc import MARK, Hello, expected_tensor

ROOT = Path(__file__).resolve().parents[2]
KIB4, MIB4 = 4096, 4 << 20


def uniq(stage: str) -> str:
    return f"{stage}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Owner:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self, timeout: float = 15.0) -> bytes:
        """Next protocol line (skips library chatter); fails instead of hanging."""
        assert self.proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            assert raw, "owner process exited"
            if raw.startswith(MARK.encode()):
                return raw[len(MARK) :]

    async def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stats\n")
        await self.proc.stdin.drain()
        return msgspec.json.decode(await self.line(), type=dict[str, int])

    async def wait_stats(self, pred, timeout: float = 5.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        while True:
            st = await self.stats()
            if pred(st) or time.monotonic() > deadline:
                return st
            await asyncio.sleep(0.05)


@asynccontextmanager
async def owner_process(sizes: list[int], ttl_ms: int = 60_000,
                        wake_ms: int | None = None) -> AsyncIterator[tuple[Owner, Hello]]:
    quiet = [] if wake_ms is None else [str(wake_ms)]  # see owner_proc: only NIXL's thread progresses
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.transport.owner_proc",
        uniq("owner"), str(16 << 20), str(ttl_ms), ",".join(map(str, sizes)), *quiet,
        cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    try:
        owner = Owner(proc)
        hello = msgspec.json.decode(await owner.line(30.0), type=Hello)
        yield owner, hello
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def timed_get(xa: TransferAgent, hello: Hello, i: int) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    t = await xa.get(hello.agent, hello.refs[i])
    return t, (time.perf_counter() - t0) * 1e3


@pytest.mark.asyncio
async def test_remote_get_exact_bytes_then_release() -> None:
    async with owner_process([KIB4, MIB4, KIB4]) as (owner, hello):
        async with TransferAgent(uniq("consumer"), 16 << 20, shared_pool=False) as xa:
            small, first_ms = await timed_get(xa, hello, 0)  # includes lazy connect
            big, _ = await timed_get(xa, hello, 1)
            assert small.dtype == torch.float32 and small.shape == (1024,)
            assert torch.equal(small, expected_tensor(KIB4, 0))
            assert torch.equal(big, expected_tensor(MIB4, 1))
            lat = {}
            for i, n in ((0, KIB4), (1, MIB4)):
                samples = sorted([(await timed_get(xa, hello, i))[1] for _ in range(20)])
                lat[n] = samples[len(samples) // 2]
            print(f"\nfirst get (connect) {first_ms:.2f} ms; warm median get: "
                  f"4KiB {lat[KIB4]:.3f} ms, 4MiB {lat[MIB4]:.3f} ms")

            # Concurrent pulls, and the caller owns its tensors (no aliasing).
            many = await xa.get_many([(hello.agent, r) for r in hello.refs])
            for i, (t, n) in enumerate(zip(many, (KIB4, MIB4, KIB4))):
                assert torch.equal(t, expected_tensor(n, i))
            many[0].zero_()
            assert torch.equal(await xa.get(hello.agent, hello.refs[0]), expected_tensor(KIB4, 0))
            st = xa.stats()
            assert st["used_bytes"] == 0 and st["inflight"] == 0  # staging slots freed
            assert st["transfers"] == 2 + 40 + 3 + 1 and st["remote_agents"] == 1

            before = await owner.stats()
            assert before["leases_outstanding"] == 3
            await xa.release(hello.agent, [hello.refs[0].lease, hello.refs[1].lease, 999_999])
            after = await owner.wait_stats(lambda s: s["leases_outstanding"] == 1)
            assert after["leases_outstanding"] == 1
            assert after["released_leases"] == 2  # the unknown id was ignored
            assert after["used_bytes"] == before["used_bytes"] - KIB4 - MIB4


@pytest.mark.asyncio
async def test_progress_thread_serves_reads_while_owner_python_sleeps() -> None:
    """NIXL's event-driven progress thread answers peers' READs with nothing polling from the
    owner's Python; without the thread the same quiet owner never serves one (the control)."""
    async with owner_process([KIB4, MIB4], wake_ms=100) as (_owner, hello):
        async with TransferAgent(uniq("consumer"), 8 << 20, shared_pool=False) as xa:
            for _ in range(5):
                for i, n in enumerate((KIB4, MIB4)):
                    t = await xa.get(hello.agent, hello.refs[i], timeout_ms=5_000)
                    assert torch.equal(t, expected_tensor(n, i))
    async with owner_process([KIB4], wake_ms=0) as (_owner, hello):
        async with TransferAgent(uniq("consumer"), 1 << 20, shared_pool=False) as xa:
            with pytest.raises(OwnerGoneError):
                await xa.get(hello.agent, hello.refs[0], timeout_ms=1_500)


@pytest.mark.asyncio
async def test_lease_ttl_expiry_frees_owner_slot() -> None:
    async with owner_process([KIB4, KIB4], ttl_ms=400) as (owner, hello):
        st = await owner.wait_stats(lambda s: s["leases_outstanding"] == 0, timeout=5.0)
        assert st["leases_outstanding"] == 0 and st["expired_leases"] == 2
        assert st["used_bytes"] == 0
        # A release for an expired lease is ignored, not an error.
        # (the consumer stays up until the owner heard it: the first notification to a new peer
        # waits for the connection, and closing the agent earlier cancels the send)
        async with TransferAgent(uniq("consumer"), 1 << 20, shared_pool=False) as xa:
            await xa.release(hello.agent, [hello.refs[0].lease])
            st = await owner.wait_stats(lambda s: s["release_notifs_received"] == 1, timeout=10.0)
        assert st["released_leases"] == 0 and st["release_notifs_received"] == 1


@pytest.mark.asyncio
async def test_an_idle_agent_polls_progress_at_the_idle_interval() -> None:
    """With nothing in flight progress polls every ``IDLE_POLL_MS`` (100 ms): at 20 ms each
    process of an idle fleet polled ~50 times a second. A put's lease wakes one poll, no more."""
    xa = TransferAgent(uniq("idle"), 1 << 20)
    polls = []
    poll = xa._progress._poll
    xa._progress._poll = lambda: (polls.append(time.monotonic()), poll())
    async with xa:
        await asyncio.sleep(1.0)
        idle = len(polls)
        ref = xa.put(torch.arange(64, dtype=torch.uint8))
        await asyncio.sleep(0.5)
        xa.free_local(ref.lease)
    assert 1 <= idle <= 15, idle  # ~10 (timers run late on a busy machine: fewer, never more)
    assert len(polls) - idle <= 9, len(polls) - idle


@pytest.mark.asyncio
async def test_stopped_then_sigkilled_owner_raises_owner_gone() -> None:
    async with owner_process([KIB4, KIB4]) as (owner, hello):
        async with TransferAgent(uniq("consumer"), 1 << 20, shared_pool=False) as xa:
            # A frozen owner cannot finish the connection handshake: bounded by the timeout.
            owner.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(OwnerGoneError, match="timed out"):
                await xa.get(hello.agent, hello.refs[0], timeout_ms=500)
            assert 0.45 < time.monotonic() - t0 < 2.0
            assert xa.stats()["used_bytes"] == 0 and xa.stats()["quarantined_bytes"] == 0
            owner.proc.send_signal(signal.SIGCONT)
            t = await xa.get(hello.agent, hello.refs[0])  # reconnects
            assert torch.equal(t, expected_tensor(KIB4, 0))
            owner.proc.send_signal(signal.SIGKILL)
            await owner.proc.wait()
            t0 = time.monotonic()
            with pytest.raises(OwnerGoneError):
                await xa.get(hello.agent, hello.refs[1], timeout_ms=3000)
            connected_s = time.monotonic() - t0
            # A consumer that never connected to the dead owner.
            async with TransferAgent(uniq("late"), 1 << 20, shared_pool=False) as late:
                t0 = time.monotonic()
                with pytest.raises(OwnerGoneError):
                    await late.get(hello.agent, hello.refs[1], timeout_ms=3000)
                fresh_s = time.monotonic() - t0
            print(f"\nOwnerGoneError after SIGKILL: connected peer {connected_s * 1e3:.1f} ms, "
                  f"never-connected peer {fresh_s * 1e3:.1f} ms")
            assert connected_s < 3.5 and fresh_s < 3.5
            assert xa.stats()["used_bytes"] == 0 and xa.stats()["transfer_errors"] == 2
            await xa.release(hello.agent, [hello.refs[1].lease])  # dead owner: no raise


@pytest.mark.asyncio
async def test_local_get_put_wait_and_pool_full() -> None:
    async with TransferAgent(uniq("local"), 64 << 10, lease_ttl_ms=60_000) as xa:
        srcs = [
            torch.randn(3, 5),
            torch.randn(4, 4).to(torch.bfloat16),
            torch.arange(7, dtype=torch.int64),
            torch.arange(9, dtype=torch.int32).reshape(3, 3).t(),  # non-contiguous
            torch.tensor(3.5, dtype=torch.float16),  # 0-dim
            torch.arange(10, dtype=torch.uint8),
        ]
        refs = [xa.put(s) for s in srcs]
        for s, r in zip(srcs, refs):
            assert r.dtype == str(s.dtype).removeprefix("torch.") and r.shape == tuple(s.shape)
            out = await xa.get(xa.ref(), r)
            assert out.dtype == s.dtype and torch.equal(out, s)
        out = await xa.get(xa.ref(), refs[0])
        out.fill_(0)  # must not alias the pool
        assert torch.equal(await xa.get(xa.ref(), refs[0]), srcs[0])
        assert xa.stats()["local_gets"] == len(srcs) + 2 and xa.stats()["transfers"] == 0

        assert xa.free_local(refs[0].lease) and not xa.free_local(refs[0].lease)
        with pytest.raises(OwnerGoneError):
            await xa.get(xa.ref(), refs[0])
        await xa.release(xa.ref(), [r.lease for r in refs[1:]])
        assert xa.stats()["leases_outstanding"] == 0 and xa.stats()["used_bytes"] == 0

        block = torch.zeros(16 << 10, dtype=torch.uint8)
        held = [xa.put(block) for _ in range(4)]
        with pytest.raises(PoolFullError):
            xa.put(block)
        with pytest.raises(PoolFullError):
            xa.put(torch.zeros(1 << 20, dtype=torch.uint8))  # larger than the pool
        t0 = time.monotonic()
        with pytest.raises(PoolFullError):
            await xa.put_wait(block, timeout_ms=50)
        assert 0.04 < time.monotonic() - t0 < 1.0

        async def free_soon() -> None:
            await asyncio.sleep(0.05)
            xa.free_local(held[0].lease)

        task = asyncio.create_task(free_soon())
        ref = await xa.put_wait(block, timeout_ms=2000)
        await task
        assert ref.nbytes == block.numel() and xa.stats()["leases_outstanding"] == 4
        with pytest.raises(ValueError):
            xa.put(torch.zeros(2, dtype=torch.float64))


@pytest.mark.asyncio
async def test_a_local_get_of_a_kept_source_is_the_put_tensor_itself() -> None:
    """``put_wait(keep_source=True)``: this process's get of the slot is the tensor put (no copy
    out of the pool, e.g. pixels media-fetch hands to encode in the same worker); the pool still
    holds the bytes for other readers; once the slot is freed the tensor is let go, and a slot
    reused by a plain put is copied out as before. Without keep_source a get is a copy."""
    async with TransferAgent(uniq("keep"), 1 << 20, lease_ttl_ms=60_000) as xa:
        pixels = torch.randn(6, 1176)
        kept = await xa.put_wait(pixels, timeout_ms=1000, keep_source=True)
        out = await xa.get(xa.ref(), kept)
        assert out.data_ptr() == pixels.data_ptr() and torch.equal(out, pixels) and out.shape == (6, 1176)
        off = kept.addr - xa._base
        assert torch.equal(xa._tbuf[off: off + kept.nbytes].view(torch.float32).reshape(6, 1176), pixels)
        plain = await xa.put_wait(pixels, timeout_ms=1000)
        assert (await xa.get(xa.ref(), plain)).data_ptr() != pixels.data_ptr()
        assert xa.free_local(kept.lease) and xa.free_local(plain.lease)
        assert xa._sources == {}  # nothing kept alive past its slot
        again = await xa.put_wait(torch.ones(6, 1176), timeout_ms=1000)  # the first slot, reused
        assert again.addr == kept.addr
        assert torch.equal(await xa.get(xa.ref(), again), torch.ones(6, 1176))
        expiring = await xa.put_wait(pixels, timeout_ms=1000, keep_source=True)
        xa._expire(time.monotonic() + 120)  # its lease's TTL passes
        assert xa._sources == {} and xa.stats()["leases_outstanding"] == 0
        with pytest.raises(OwnerGoneError):
            await xa.get(xa.ref(), expiring)


@pytest.mark.asyncio
async def test_pinned_slot_outlives_releases_and_is_freed_after_unpin() -> None:
    """A cache pins a slot: consumers' leases (``share``) end without freeing it, a ``lease == 0``
    ref reads it locally while pinned, and unpinning frees it once no lease is left."""
    async with TransferAgent(uniq("owner"), 1 << 20, lease_ttl_ms=60_000) as xa:
        t = torch.arange(256, dtype=torch.float32)
        ref = xa.put(t)
        xa.pin(ref)
        shared = xa.share(ref)
        assert shared.lease not in (0, ref.lease) and shared.addr == ref.addr
        await xa.release(xa.ref(), [ref.lease, shared.lease])
        pinned = msgspec.structs.replace(ref, lease=0)
        assert torch.equal(await xa.get(xa.ref(), pinned), t)
        assert xa.stats()["used_bytes"] > 0 and xa.stats()["pinned_slots"] == 1
        reader = xa.share(ref)
        xa.unpin(ref)
        with pytest.raises(OwnerGoneError):
            await xa.get(xa.ref(), pinned)  # no longer pinned: a lease-0 ref is refused
        assert torch.equal(await xa.get(xa.ref(), reader), t)  # the reader's lease still holds it
        assert xa.free_local(reader.lease)
        assert xa.stats()["used_bytes"] == 0
