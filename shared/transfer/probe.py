"""A bandwidth probe of every transfer path this host offers, between two real processes
(``mmfleet doctor``; ``make gpu-check`` prints it too). The prober starts a peer (``python -m
shared.transfer.probe --peer``) owning a :class:`~shared.transfer.TransferAgent` on the same
device that ``put``s one seeded random tensor per size; the prober times the median of
``repeats`` pulls of each path (:func:`probe`) and checks every byte. Frames between the two are
length-prefixed msgpack on the peer's stdin / stdout.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable

import msgspec
import torch

from shared.protocol import AgentRef, TensorRef

__all__ = ["Row", "probe", "format_rows"]

MIB = 1 << 20


# The probe's private protocol (the prober ↔ its peer process over a pipe; never on the fleet's
# wire, see shared.protocol): Hello, then PutReq → PutDone per size.
class Hello(msgspec.Struct, frozen=True):
    agent: AgentRef
    refs: list[TensorRef]
    vram_agent: str = ""
    vram_meta: bytes = b""
    vram_addr: int = 0
    vram_device_id: int = 0
    vram_bytes: int = 0


class PutReq(msgspec.Struct, frozen=True):
    """Prober → peer: put ``count`` fresh tensors of ``size_mib`` back to back, answering each
    as its put returns (after freeing ``free_leases``)."""

    size_mib: int
    count: int = 1
    free_leases: list[int] = []


class PutDone(msgspec.Struct, frozen=True):
    """Peer → prober: its ref, when the put began (``time.perf_counter``, the host's monotonic
    clock, which both processes share) and how long the put call took."""

    ref: TensorRef
    t_start: float
    put_s: float


class Row(msgspec.Struct, frozen=True):
    path: str
    size_mib: int
    gb_s: float  # 1e9 bytes per second, median of the repeats
    ok: bool  # every byte as expected
    note: str = ""


def _pattern(nbytes: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _median_s(fn: Callable[[], Awaitable[object]], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up (lazy connect, allocator)
        _sync(device)
        t0 = time.perf_counter()
        await fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _nixl_agent(name: str):
    from shared.transfer.nixl_thread import make_agent

    return make_agent(name, wake_ms=0)[0]  # the probe polls its raw VRAM agents itself


# ---------------------------------------------------------------- the peer (owner) process

def frames_stdout():
    """A binary file on the real stdout for frames; fd 1 then points at stderr, so whatever a
    library prints (nixl, UCX, transformers) cannot corrupt the frame stream."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return out


async def _peer(device: torch.device, sizes: list[int]) -> None:
    from shared.transfer.agent import TransferAgent

    out = frames_stdout()
    total = sum(s * MIB for s in sizes) + _stream_bytes(sizes)  # the resident refs + the fresh puts
    agent = TransferAgent(f"probe-owner-{os.getpid()}", total + 4096 * (len(sizes) + 2 * _STREAM_MIB), device=device,
                          cuda_ipc=True)
    await agent.start()
    srcs = {s: _pattern(s * MIB, device, s) for s in sizes}
    refs = [agent.put(srcs[s]) for s in sizes]
    hello = Hello(agent.ref(), refs)
    vram = None
    if device.type == "cuda":  # raw NIXL on VRAM: what UCX does with GPU memory on this host
        vram = _nixl_agent(f"probe-vram-owner-{os.getpid()}")
        src = _pattern(max(sizes) * MIB, device, 0)
        reg = vram.register_memory(src)
        hello = msgspec.structs.replace(hello, vram_agent=vram.name, vram_meta=vram.get_agent_metadata(),
                                        vram_addr=src.data_ptr(), vram_device_id=device.index or 0,
                                        vram_bytes=src.numel())
    out.write(frame(hello))
    out.flush()

    async def vram_progress():  # an owner must make progress for a new peer's first READ
        while True:
            vram.get_new_notifs()
            await asyncio.sleep(0.001)

    progress = asyncio.create_task(vram_progress()) if vram is not None else None
    loop = asyncio.get_running_loop()
    read = sys.stdin.buffer.read
    while len(head := await loop.run_in_executor(None, read, 4)) == 4:  # the prober closes stdin when done
        req = msgspec.msgpack.decode(await loop.run_in_executor(None, read, struct.unpack("<I", head)[0]),
                                     type=PutReq)
        for lease in req.free_leases:
            agent.free_local(lease)
        _sync(device)
        for _ in range(req.count):
            t0 = time.perf_counter()
            ref = agent.put(srcs[req.size_mib])
            out.write(frame(PutDone(ref, t0, time.perf_counter() - t0)))
            out.flush()
    if progress is not None:
        progress.cancel()
        vram.deregister_memory(reg)
    await agent.stop()


def _stream_bytes(sizes: list[int]) -> int:
    return max(max(2, _STREAM_MIB // s) * s for s in sizes) * MIB


def frame(obj) -> bytes:
    """A length-prefixed msgpack frame (the probe's and the GPU check's pipes)."""
    body = msgspec.msgpack.encode(obj)
    return struct.pack("<I", len(body)) + body


async def read_frame(stream: asyncio.StreamReader, type_, timeout_s: float):
    head = await asyncio.wait_for(stream.readexactly(4), timeout_s)
    return msgspec.msgpack.decode(await stream.readexactly(struct.unpack("<I", head)[0]), type=type_)


# ---------------------------------------------------------------- the prober

async def probe(device: str = "cpu", sizes_mib: tuple[int, ...] = (1, 16, 256), repeats: int = 5) -> list[Row]:
    """Rows of (path, size, GB/s, ok) for every path this host offers:

    - ``pinned copy H2D`` / ``D2H``: the reference, torch copies between pinned host memory and
      the GPU in one process;
    - ``staging get``: the agent's NIXL DRAM READ of the peer's pinned slot + pinned→device copy;
    - ``shm-staging get``: the agent copying from its mapping of the peer's pinned pool to its GPU;
    - ``staging end-to-end`` / ``shm-staging end-to-end``: a fresh ``put`` at the peer pulled at
      once, timed from the peer's ``put`` call (the host's clock, shared by both) to the bytes on
      this GPU, so the owner's device→pinned copy is in it, overlapping the pull;
    - ``... stream``: the same as throughput, 512 MiB of fresh puts pulled as each ref arrives;
    - ``cuda-ipc get``: the agent opening the peer's IPC handle, device→device;
    - ``nixl-vram``: a raw NIXL READ of GPU memory the peer registered as VRAM.

    On a CPU-only host: ``staging get`` (a NIXL READ, host pool to host pool) and ``host-shm get``
    (a copy out of this process's mapping of the peer's pool)."""
    from shared.process.device import resolve_placement
    from shared.transfer.agent import TransferAgent

    dev = resolve_placement(device).device
    sizes = list(sizes_mib)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shared.transfer.probe", "--peer", "--device", str(dev),
        "--sizes", ",".join(map(str, sizes)), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    rows: list[Row] = []
    agent = None
    try:
        hello = await read_frame(proc.stdout, Hello, 120)
        agent = TransferAgent(f"probe-puller-{os.getpid()}", 2 * max(sizes) * MIB, device=dev, cuda_ipc=True)
        await agent.start()
        fresh = _Fresh(proc)
        for size, ref in zip(sizes, hello.refs, strict=True):
            rows += await _probe_size(agent, hello, fresh, ref, size, dev, repeats)
    finally:
        if agent is not None:
            await agent.stop()
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    return rows


class _Fresh:
    """The prober's line to the peer for fresh puts (each request frees the last one's)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc, self._leases = proc, []

    async def ask(self, size_mib: int, count: int = 1) -> None:
        self._proc.stdin.write(frame(PutReq(size_mib, count, self._leases)))
        self._leases = []
        await self._proc.stdin.drain()

    async def next(self) -> PutDone:
        done = await read_frame(self._proc.stdout, PutDone, 60)
        self._leases.append(done.ref.lease)
        return done


_STRIP = {"staging": {"cuda_ipc": None, "host_shm": None}, "shm-staging": {"cuda_ipc": None}}
_STREAM_MIB = 512  # per stream: 32 x 16 MiB, 2 x 256 MiB


async def _end_to_end(agent, hello: Hello, fresh: _Fresh, size: int, path: str, expect: torch.Tensor,
                      repeats: int, t_h2d: float) -> Row:
    """A fresh put at the peer, pulled at once by ``path``: from the peer's ``put`` call to the
    bytes on this GPU, the owner's device→pinned copy included (it overlaps the pull)."""
    times, puts, got = [], [], None
    for _ in range(repeats + 1):  # the first warms up
        await fresh.ask(size)
        done = await fresh.next()
        got = await agent.get(hello.agent, msgspec.structs.replace(done.ref, **_STRIP[path]))
        _sync(expect.device)
        times.append(time.perf_counter() - done.t_start)
        puts.append(done.put_s)
    t = statistics.median(times[1:])
    return Row(f"{path} end-to-end (put -> get)", size, size * MIB / t / 1e9, bool(torch.equal(got, expect)),
               f"{t_h2d / t:.0%} of pinned H2D; put returned in {statistics.median(puts[1:]) * 1e3:.2f} ms")


async def _stream(agent, hello: Hello, fresh: _Fresh, size: int, path: str, expect: torch.Tensor,
                  repeats: int, t_h2d: float) -> Row:
    """Bandwidth as throughput: the peer puts ``_STREAM_MIB`` worth of fresh tensors back to
    back and this side pulls each as its ref arrives, so one transfer's fixed costs (the put's
    launches, the hand-off, the pull's set-up) overlap the others' copies. Timed from the first
    put's call to the last tensor on this GPU; every tensor is checked after the clock stops
    (a check is a kernel and a wait: inside the loop it would keep each pull from overlapping
    the next one's set-up)."""
    count = max(2, _STREAM_MIB // size)
    times, ok = [], True
    for _ in range(repeats + 1):  # the first warms up
        await fresh.ask(size, count)
        t_start, got = None, []
        for _ in range(count):
            done = await fresh.next()
            t_start = done.t_start if t_start is None else t_start
            got.append(await agent.get(hello.agent, msgspec.structs.replace(done.ref, **_STRIP[path])))
        _sync(expect.device)
        times.append(time.perf_counter() - t_start)
        ok = ok and all(torch.equal(g, expect) for g in got)
    t = statistics.median(times[1:]) / count
    return Row(f"{path} stream ({count} x put -> get)", size, size * MIB / t / 1e9, ok,
               f"{t_h2d / t:.0%} of pinned H2D")


async def _probe_size(agent, hello: Hello, fresh: _Fresh, ref: TensorRef, size: int, dev: torch.device,
                      repeats: int) -> list[Row]:
    n = size * MIB
    expect = _pattern(n, dev, size)
    rows: list[Row] = []
    t_d2h = None
    if dev.type == "cuda":
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(n, dtype=torch.uint8, device=dev)

        async def h2d():
            gpu.copy_(host)

        async def d2h():
            host.copy_(expect)

        t_d2h = await _median_s(d2h, repeats, dev)  # first: it fills ``host`` with the pattern
        t_h2d = await _median_s(h2d, repeats, dev)
        rows += [Row("pinned copy H2D", size, n / t_h2d / 1e9, bool(torch.equal(gpu, expect))),
                 Row("pinned copy D2H", size, n / t_d2h / 1e9, bool(torch.equal(host.to(dev), expect)))]
    staged = msgspec.structs.replace(ref, cuda_ipc=None, host_shm=None)
    got: list[torch.Tensor] = []

    async def staging():
        got[:] = [await agent.get(hello.agent, staged)]

    t_get = await _median_s(staging, repeats, dev)
    ok = got[0].device == expect.device and bool(torch.equal(got[0], expect))
    rows.append(Row("staging get (NIXL DRAM + pinned->device)" if dev.type == "cuda" else "staging get (NIXL DRAM)",
                    size, n / t_get / 1e9, ok))
    if t_d2h is not None:
        rows += [await _end_to_end(agent, hello, fresh, size, "staging", expect, repeats, t_h2d),
                 await _stream(agent, hello, fresh, size, "staging", expect, repeats, t_h2d)]
    if ref.host_shm is not None:
        shm_ref = msgspec.structs.replace(ref, cuda_ipc=None)
        before = agent.stats()["shm_gets"]

        async def shm():
            got[:] = [await agent.get(hello.agent, shm_ref)]

        t_shm = await _median_s(shm, repeats, dev)
        used = agent.stats()["shm_gets"] > before
        ok = used and bool(torch.equal(got[0], expect))
        note = "" if used else "pool not mapped: fell back to NIXL"
        if dev.type != "cuda":  # a CPU peer's pool, mapped here: one host copy
            rows.append(Row("host-shm get (mapped pool)", size, n / t_shm / 1e9, ok, note))
        else:
            rows += [Row("shm-staging get (shared pinned pool->device)", size, n / t_shm / 1e9, ok, note),
                     await _end_to_end(agent, hello, fresh, size, "shm-staging", expect, repeats, t_h2d),
                     await _stream(agent, hello, fresh, size, "shm-staging", expect, repeats, t_h2d)]
    if ref.cuda_ipc is not None:
        before = agent.stats()["ipc_gets"]

        async def ipc():
            got[:] = [await agent.get(hello.agent, ref)]

        t_ipc = await _median_s(ipc, repeats, dev)
        used = agent.stats()["ipc_gets"] > before
        rows.append(Row("cuda-ipc get", size, n / t_ipc / 1e9, used and bool(torch.equal(got[0], expect)),
                        "" if used else "handle not opened: fell back to staging"))
    if hello.vram_agent:
        rows.append(await _probe_vram(hello, size, dev, repeats))
    return rows


async def _probe_vram(hello: Hello, size: int, dev: torch.device, repeats: int) -> Row:
    n = size * MIB
    nx = _nixl_agent(f"probe-vram-puller-{os.getpid()}-{size}")
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    reg = nx.register_memory(dst)
    try:
        nx.add_remote_agent(hello.vram_meta)
        local = nx.get_xfer_descs([(dst.data_ptr(), n, dev.index or 0)], "VRAM")
        remote = nx.get_xfer_descs([(hello.vram_addr, n, hello.vram_device_id)], "VRAM")

        async def read():
            h = nx.initialize_xfer("READ", local, remote, hello.vram_agent, b"")
            state = nx.transfer(h)
            deadline = time.monotonic() + 60
            while state == "PROC" and time.monotonic() < deadline:
                await asyncio.sleep(0)
                state = nx.check_xfer_state(h)
            nx.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL VRAM READ ended {state}")

        t = await _median_s(read, min(repeats, 2) if size >= 64 else repeats, dev)
        ok = bool(torch.equal(dst, _pattern(hello.vram_bytes, dev, 0)[:n]))  # the owner's, seed 0
        return Row("nixl-vram READ", size, n / t / 1e9, ok)
    except Exception as exc:  # a host whose UCX cannot reach VRAM at all
        return Row("nixl-vram READ", size, 0.0, False, f"{type(exc).__name__}: {exc}")
    finally:
        nx.deregister_memory(reg)


async def doctor_report(device: str, sizes_mib: tuple[int, ...] = (1, 16, 256)) -> str:
    """What ``mmfleet doctor`` prints: the device, the paths an agent there would use, and the
    probe's table."""
    from shared.process.device import host_id, resolve_placement
    from shared.transfer.paths import describe_paths

    placement = resolve_placement(device)
    dev = placement.device
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, host {host_id()}"]
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        lines.append(f"device {dev}: {props.name}, {props.total_memory / 2**30:.0f} GiB, dtype auto = "
                     f"{str(placement.dtype).removeprefix('torch.')}")
    else:
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        lines.append(f"device cpu (GPUs visible to torch: {n_gpus})")
    lines.append(describe_paths(dev, 256 * MIB, ipc=True))
    lines.append(format_rows(await probe(str(dev), sizes_mib)))
    return "\n".join(lines)


def format_rows(rows: list[Row]) -> str:
    lines = [f"{'path':44} {'MiB':>5} {'GB/s':>9}  ok"]
    lines += [f"{r.path:44} {r.size_mib:>5} {r.gb_s:>9.2f}  {'yes' if r.ok else 'NO'} {r.note}".rstrip()
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shared.transfer.probe")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="1,16,256", help="MiB, comma-separated")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.peer:
        asyncio.run(_peer(torch.device(args.device), sizes))
        return 0
    print(format_rows(asyncio.run(probe(args.device, tuple(sizes)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
