"""The GPU check (``make gpu-check``, ``pytest -m gpu``): encode, prefill and decode in three
separate processes on CUDA, tensors moving between them through the transfer layer, must give
exactly the tokens of an in-process ``generate()`` for a text and an image prompt; then the
transfer-path probe (:mod:`shared.transfer.probe`). Prints device, paths, parity, TTFT and GB/s.

No Kafka, no Redis: a driver plays the gateway and media-fetch and forwards descriptors over the
stages' stdin/stdout. Each flow runs as shipped (CUDA IPC), then with the IPC handles stripped
down to the shared pinned pool and to NIXL staging; the agents' counters prove each pull's path.
Exits 0 when every parity holds and every probed byte arrived; 2 with no GPU. Design: docs/deploy/gpus.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

from shared.protocol import AgentRef, TensorRef
from shared.transfer.probe import frame, frames_stdout

QUESTION = "What is in the image?"


class Job(msgspec.Struct, tag=True):
    """Driver → stage: one unit of work (fields used by the stage that receives it)."""

    owner: AgentRef | None = None
    refs: list[TensorRef] = []
    grids: list[tuple[int, int, int]] = []
    n_tokens: list[int] = []
    prompt_ids: list[int] = []
    rope_delta: int = 0
    prompt_len: int = 0
    first_token: int = 0
    max_tokens: int = 0


class Stats(msgspec.Struct, tag=True):
    pass


class Done(msgspec.Struct):
    refs: list[TensorRef] = []
    tokens: list[int] = []
    rope_delta: int = 0
    prompt_len: int = 0
    stats: dict[str, int] = {}
    agent: AgentRef | None = None
    error: str = ""


_IN = msgspec.msgpack.Decoder(Job | Stats)
_OUT = msgspec.msgpack.Decoder(Done)


# ---------------------------------------------------------------- a stage process

async def _stage(stage: str, model_dir: str, device: str, dtype: str) -> None:
    from shared.engines.qwen2_vl import MediaPixels
    from shared.engines.transformers_engine import compute_class
    from shared.transfer import TransferAgent

    out = frames_stdout()
    compute = compute_class(model_dir)(model_dir, device=device, dtype=dtype)
    agent = TransferAgent(f"gpucheck-{stage}-{os.getpid()}", 64 << 20, device=compute.device, cuda_ipc=True)
    await agent.start()
    loop = asyncio.get_running_loop()
    read = sys.stdin.buffer.read
    out.write(frame(Done(agent=agent.ref())))
    out.flush()
    while True:
        head = await loop.run_in_executor(None, read, 4)
        if len(head) < 4:
            break
        msg = _IN.decode(await loop.run_in_executor(None, read, struct.unpack("<I", head)[0]))
        try:
            reply = Done(stats=agent.stats()) if isinstance(msg, Stats) else await _work(stage, compute, agent, msg,
                                                                                          MediaPixels)
        except Exception as exc:  # reported to the driver, which fails the check with it
            reply = Done(error=f"{stage}: {type(exc).__name__}: {exc}")
        out.write(frame(reply))
        out.flush()
    await agent.stop()


async def _work(stage: str, compute, agent, job: Job, MediaPixels) -> Done:
    tensors = await agent.get_many([(job.owner, r) for r in job.refs]) if job.refs else []
    if job.refs:
        await agent.release(job.owner, [r.lease for r in job.refs])
    if stage == "encode":
        items = [MediaPixels(t, g, n) for t, g, n in zip(tensors, job.grids, job.n_tokens, strict=True)]
        return Done(refs=[agent.put(e) for e in compute.encode_media(items)])
    if stage == "prefill":
        out = compute.prefill(job.prompt_ids, [(t, g, "image") for t, g in zip(tensors, job.grids, strict=True)])
        first = int(out.last_logits.argmax())
        return Done(refs=[agent.put(out.kv)], tokens=[first], rope_delta=out.rope_delta, prompt_len=out.prompt_len)
    state = compute.start_decode(tensors[0], job.rope_delta, job.prompt_len)  # decode
    tokens = [job.first_token]
    while len(tokens) < job.max_tokens and tokens[-1] not in compute.eos_token_ids:
        tokens.append(int(compute.decode_step(state, tokens[-1]).argmax()))
    return Done(tokens=tokens[1:])


# ---------------------------------------------------------------- the driver

class _Proc:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def call(self, msg) -> Done:
        self.proc.stdin.write(frame(msg))
        await self.proc.stdin.drain()
        return await self.read()

    async def read(self) -> Done:
        head = await asyncio.wait_for(self.proc.stdout.readexactly(4), 300)
        done = _OUT.decode(await self.proc.stdout.readexactly(struct.unpack("<I", head)[0]))
        if done.error:
            raise RuntimeError(done.error)
        return done


_PATHS = {"cuda-ipc": {}, "shm": {"cuda_ipc": None}, "nixl": {"cuda_ipc": None, "host_shm": None}}
_COUNTER = {"cuda-ipc": "ipc_gets", "shm": "shm_gets", "nixl": "transfers"}


def _strip(refs: list[TensorRef], path: str) -> list[TensorRef]:
    """The refs as a consumer would see them if only ``path`` (and the slower ones) were offered."""
    return [msgspec.structs.replace(r, **_PATHS[path]) for r in refs]


async def _epd(procs: dict[str, _Proc], owners: dict[str, AgentRef], agent, prompt_ids: list[int],
               pixels, max_tokens: int, path: str) -> tuple[list[int], float]:
    """One request through E → P → D; returns its tokens and TTFT (s, from the pixels' put)."""
    t0 = time.perf_counter()
    grids = [p.grid_thw for p in pixels]
    embeds: list[TensorRef] = []
    if pixels:
        refs = [agent.put(p.pixel_values) for p in pixels]
        enc = await procs["encode"].call(Job(owner=agent.ref(), refs=refs, grids=grids,
                                             n_tokens=[p.n_tokens for p in pixels]))
        embeds = _strip(enc.refs, path)
    pre = await procs["prefill"].call(Job(owner=owners["encode"], refs=embeds, grids=grids, prompt_ids=prompt_ids))
    ttft = time.perf_counter() - t0
    dec = await procs["decode"].call(Job(owner=owners["prefill"], refs=_strip(pre.refs, path),
                                         rope_delta=pre.rope_delta,
                                         prompt_len=pre.prompt_len, first_token=pre.tokens[0], max_tokens=max_tokens))
    return pre.tokens + dec.tokens, ttft


async def _parity(model_dir: Path, device: str, dtype: str, max_tokens: int) -> list[str]:
    """Lines of the parity report; raises AssertionError on a mismatch."""
    from PIL import Image

    from shared.engines.qwen2_vl import ImagePreprocessor
    from shared.models.reference import load_reference, reference_generate
    from shared.transfer import TransferAgent

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    prompts = {"text": ([{"role": "user", "content": QUESTION}], []),
               "image": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                         [image])}
    loaded = load_reference(model_dir, device=device, dtype=dtype)
    expected = {k: reference_generate(model_dir, m, i, max_tokens, loaded=loaded) for k, (m, i) in prompts.items()}
    processor = loaded[0]
    pre = ImagePreprocessor(model_dir, processor=processor)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: dict[str, _Proc] = {}
    lines: list[str] = []
    agent = TransferAgent(f"gpucheck-driver-{os.getpid()}", 32 << 20)
    await agent.start()
    try:
        for stage in ("encode", "prefill", "decode"):
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "loadtest.gpucheck", "--stage", stage, "--model-path", str(model_dir),
                "--device", device, "--dtype", dtype, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env=env)
            procs[stage] = _Proc(p)
        owners = {s: (await p.read()).agent for s, p in procs.items()}
        for path in ("cuda-ipc", "shm", "nixl") if device.startswith("cuda") else ("nixl",):
            before = {s: (await p.call(Stats())).stats for s, p in procs.items()}
            for name, (msgs, imgs) in prompts.items():
                text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                ids = list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
                pixels = [pre(im) for im in imgs]
                ttfts = []
                for _ in range(4):  # the first is the cold one (connects, allocator, kernels)
                    got, ttft = await _epd(procs, owners, agent, ids, pixels, max_tokens, path)
                    ttfts.append(ttft)
                    assert got == expected[name], f"{dtype} {name} ({path}): " \
                                                  f"E/P/D {got} != generate() {expected[name]}"
                lines.append(f"parity {dtype:8} {name:5} via {path:8}: OK "
                             f"{len(got)} tokens {got[:6]}...; TTFT cold {ttfts[0] * 1e3:.1f} ms, "
                             f"warm median {statistics.median(ttfts[1:]) * 1e3:.1f} ms")
            after = {s: (await p.call(Stats())).stats for s, p in procs.items()}
            n = {k: sum(after[s][c] - before[s][c] for s in ("prefill", "decode")) for k, c in _COUNTER.items()}
            px = {k: after["encode"][c] - before["encode"][c] for k, c in _COUNTER.items()}
            lines.append(f"  pulls by prefill and decode: {n['cuda-ipc']} CUDA IPC, {n['shm']} shared pinned pool, "
                         f"{n['nixl']} NIXL; the pixels (driver -> encode): {px['shm']} mapped host pool, "
                         f"{px['nixl']} NIXL")
            # the pixels come from the driver, a CPU agent: whatever path the stages are offered,
            # they take the owner's mapped pool (host-shm) on one host, so only the stages' own
            # tensors (embeddings, KV) show which path was named
            assert all((n[k] > 0) == (k == path) for k in ("cuda-ipc", "shm")), f"{path}: pulls {n}"
    finally:
        for p in procs.values():
            p.proc.stdin.close()
        for p in procs.values():
            try:
                await asyncio.wait_for(p.proc.wait(), 60)
            except TimeoutError:
                p.proc.kill()
                await p.proc.wait()
        await agent.stop()
    return lines


async def _check(model_dir: Path, device: str, dtypes: list[str], max_tokens: int, sizes: tuple[int, ...]) -> int:
    from shared.transfer.probe import doctor_report

    failed = False
    for dtype in dtypes:
        try:
            for line in await _parity(model_dir, device, dtype, max_tokens):
                print(line, flush=True)
        except AssertionError as exc:
            failed = True
            print(f"PARITY FAILED: {exc}", flush=True)
    report = await doctor_report(device, sizes)
    print(report, flush=True)
    if " NO" in report:
        failed = True
    print("gpu-check:", "FAILED" if failed else "passed", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.gpucheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", choices=["encode", "prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default="", help="a Qwen2-VL model dir (default: build the tiny demo model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32,auto", help="comma-separated dtypes to check parity in")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--sizes", default="1,16,256", help="probe sizes, MiB")
    args = ap.parse_args(argv)
    if args.stage:
        asyncio.run(_stage(args.stage, args.model_path, args.device, args.dtype))
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check SKIPPED: torch sees no CUDA GPU on this host (nothing to check)", flush=True)
        return 2
    model_dir = Path(args.model_path) if args.model_path else _demo_model()
    return asyncio.run(_check(model_dir, args.device, args.dtype.split(","), args.max_tokens,
                              tuple(int(s) for s in args.sizes.split(","))))


def _demo_model() -> Path:
    from shared.models.registry import resolve_model_path
    from shared.settings import Settings

    return Path(resolve_model_path(Settings()))


if __name__ == "__main__":
    sys.exit(main())
