"""A bandwidth probe of every transfer path this host offers, between two real processes
(``mmfleet doctor``; ``make gpu-check`` prints it too).

The probing process starts a peer (``python -m shared.transfer.probe --peer``) that owns a
:class:`~shared.transfer.TransferAgent` on the same device and ``put``s one random tensor per
size (seeded, so the prober regenerates the expected bytes on its own device). The prober then
times, per size, the median of ``repeats`` pulls of each path and checks every byte:
- ``pinned copy H2D`` / ``D2H``: the reference, torch copies between pinned host memory and
  the GPU in one process;
- ``staging get``: the agent's NIXL DRAM READ of the peer's pinned slot + pinned→device copy;
  ``staging end-to-end`` adds the owner's device→pinned copy (the D2H time of the same size);
- ``shm-staging get``: the agent copying from its mapping of the peer's pinned pool to its GPU
  (same host), and its end-to-end with the owner's D2H;
- ``cuda-ipc get``: the agent opening the peer's IPC handle, device→device;
- ``nixl-vram``: a raw NIXL READ of GPU memory the peer registered as VRAM (what UCX offers).
On a CPU-only host only ``staging get`` (host pool to host pool) is measured. Frames between
the two processes are msgpack (msgspec), length-prefixed, on the peer's stdin/stdout.
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


class Hello(msgspec.Struct, frozen=True):
    agent: AgentRef
    refs: list[TensorRef]
    vram_agent: str = ""
    vram_meta: bytes = b""
    vram_addr: int = 0
    vram_device_id: int = 0
    vram_bytes: int = 0


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
    from shared.transfer.agent import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))


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
    total = sum(s * MIB for s in sizes)
    agent = TransferAgent(f"probe-owner-{os.getpid()}", total + len(sizes) * 4096, device=device, cuda_ipc=True)
    await agent.start()
    refs = [agent.put(_pattern(s * MIB, device, s)) for s in sizes]
    hello = Hello(agent.ref(), refs)
    vram = None
    if device.type == "cuda":  # raw NIXL on VRAM: what UCX does with GPU memory on this host
        vram = _nixl_agent(f"probe-vram-owner-{os.getpid()}")
        src = _pattern(max(sizes) * MIB, device, 0)
        reg = vram.register_memory(src)
        hello = msgspec.structs.replace(hello, vram_agent=vram.name, vram_meta=vram.get_agent_metadata(),
                                        vram_addr=src.data_ptr(), vram_device_id=device.index or 0,
                                        vram_bytes=src.numel())
    body = msgspec.msgpack.encode(hello)
    out.write(struct.pack("<I", len(body)) + body)
    out.flush()
    loop = asyncio.get_running_loop()
    eof = loop.run_in_executor(None, sys.stdin.buffer.read)  # the prober closes stdin when done
    while not eof.done():  # an owner must make progress for a new peer's first READ
        if vram is not None:
            vram.get_new_notifs()
        await asyncio.sleep(0.001)
    if vram is not None:
        vram.deregister_memory(reg)
    await agent.stop()


# ---------------------------------------------------------------- the prober

async def probe(device: str = "cpu", sizes_mib: tuple[int, ...] = (1, 16, 256), repeats: int = 5) -> list[Row]:
    """Rows of (path, size, GB/s, ok) for every path this host offers (see module doc)."""
    from shared.device import resolve_placement
    from shared.transfer.agent import TransferAgent

    dev = resolve_placement(device).device
    sizes = list(sizes_mib)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shared.transfer.probe", "--peer", "--device", str(dev),
        "--sizes", ",".join(map(str, sizes)), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    rows: list[Row] = []
    agent = None
    try:
        head = await asyncio.wait_for(proc.stdout.readexactly(4), 120)
        hello = msgspec.msgpack.decode(await proc.stdout.readexactly(struct.unpack("<I", head)[0]), type=Hello)
        agent = TransferAgent(f"probe-puller-{os.getpid()}", 2 * max(sizes) * MIB, device=dev, cuda_ipc=True)
        await agent.start()
        for size, ref in zip(sizes, hello.refs, strict=True):
            rows += await _probe_size(agent, hello, ref, size, dev, repeats)
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


async def _probe_size(agent, hello: Hello, ref: TensorRef, size: int, dev: torch.device,
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
        rows.append(Row("staging end-to-end (D2H + get)", size, n / (t_d2h + t_get) / 1e9, ok))
    if ref.host_shm is not None:
        shm_ref = msgspec.structs.replace(ref, cuda_ipc=None)
        before = agent.stats()["shm_gets"]

        async def shm():
            got[:] = [await agent.get(hello.agent, shm_ref)]

        t_shm = await _median_s(shm, repeats, dev)
        used = agent.stats()["shm_gets"] > before
        ok = used and bool(torch.equal(got[0], expect))
        note = "" if used else "pool not mapped: fell back to NIXL"
        rows += [Row("shm-staging get (shared pinned pool->device)", size, n / t_shm / 1e9, ok, note),
                 Row("shm-staging end-to-end (D2H + get)", size, n / (t_d2h + t_shm) / 1e9, ok, note)]
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
    from shared.device import host_id, resolve_placement
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
