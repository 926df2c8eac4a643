"""The decode core (shared.engines.decode_core): decode in a child process must yield exactly the
tokens of the engine's own decode on a thread — concurrent requests batched together, greedy,
seeded sampling with a penalty and logprobs, a resumed attempt — and it must survive what a
worker sees: a caller that stops early (the core drops the sequence and goes on), an abort, a
core killed mid-decode (the decodes in flight fail, the next one starts a new core), a stop, and
a core that never gets ready (each wait fails with why)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from shared import protocol
from shared.engines.base import EngineError, MediaEmbeds
from shared.engines.decode_core import CoreDecodeEngine
from shared.engines.transformers_engine import TransformersEngine
from tests.unit.test_engine_qwen2_vl import make_images, messages_for

SAMPLINGS = [
    protocol.Sampling(max_tokens=12, temperature=0.0),
    protocol.Sampling(max_tokens=9, temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.3, logprobs=2),
    protocol.Sampling(max_tokens=6, temperature=0.0, ignore_eos=True),
]


@pytest.fixture(scope="module")
async def engines(model_dir):
    thread = TransformersEngine(model_dir)
    core = CoreDecodeEngine(model_dir)
    await asyncio.gather(thread.start(), core.start())
    yield thread, core
    await asyncio.gather(thread.stop(), core.stop())


async def _prefilled(thread: TransformersEngine, n: int, long: protocol.Sampling | None = None) -> list:
    """``n`` prompts (with and without an image) prefilled by the thread engine: what a decode worker gets."""
    compute, pictures = thread.compute, list(make_images().values())
    out = []
    for i in range(n):
        images = pictures[i:i + 1] if i % 2 else []
        media = []
        for img in images:
            px = compute.preprocess_image(img)
            media.append(MediaEmbeds(await thread.encode(px.pixel_values, px.grid_thw, px.n_tokens), px.grid_thw))
        prompt = compute.render_prompt_ids(messages_for(len(images), f"prompt {i} about the sea"))
        sampling = SAMPLINGS[i % len(SAMPLINGS)] if long is None else long
        pre = await thread.prefill(f"r{i}", prompt, media, sampling)
        out.append((f"r{i}", pre, sampling, tuple(prompt)))
    return out


async def _decode(engine, rid, pre, sampling, prompt, resume=()) -> list:
    return [t async for t in engine.decode(rid, pre.kv, pre.rope_delta, pre.prompt_len, pre.first_token, sampling,
                                           resume=resume, prompt_ids=prompt)]


async def test_core_tokens_equal_the_thread_engine_batched_and_alone(engines):
    thread, core = engines
    reqs = await _prefilled(thread, 4)
    expected = [await _decode(thread, *r) for r in reqs]
    forwards, steps = core.forwards, core.steps
    got = await asyncio.gather(*(_decode(core, *r) for r in reqs))  # all four step in the core together
    assert [[int(t) for t in g] for g in got] == [[int(t) for t in e] for e in expected]
    for g, e in zip(got, expected, strict=True):  # logprobs travel with their tokens (a batched
        for a, b in zip(g, e, strict=True):  # forward's float32 sums differ in the last digits)
            la, lb = getattr(a, "logprob", None), getattr(b, "logprob", None)
            assert (la is None) == (lb is None)
            if la is not None:
                assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
                assert [i for i, _ in la.top] == [i for i, _ in lb.top]
    assert any(getattr(t, "logprob", None) is not None for g in got for t in g)
    assert core.steps - steps > core.forwards - forwards  # some forwards stepped several sequences
    # a resumed attempt: its first generated tokens are forced, the rest continue as before
    rid, pre, sampling, prompt = reqs[0]
    resumed = await _decode(core, rid, pre, sampling, prompt, resume=tuple(int(t) for t in expected[0][:3]))
    assert [int(t) for t in resumed] == [int(t) for t in expected[0]]
    # a first token that ends the completion: nothing to decode, nothing sent to the core
    forwards, eos = core.forwards, min(core.eos_token_ids)
    assert [t async for t in core.decode(rid, pre.kv, pre.rope_delta, pre.prompt_len, eos, sampling)] == []
    assert core.forwards == forwards and not core._queues


LONG = protocol.Sampling(max_tokens=400, temperature=0.0, ignore_eos=True)  # still decoding when stopped


async def test_early_stop_abort_crash_and_stop(engines):
    thread, core = engines
    ((rid, pre, sampling, prompt),) = await _prefilled(thread, 1, long=LONG)
    expected = [int(t) for t in await _decode(thread, rid, pre, sampling, prompt)]

    def start():
        return core.decode(rid, pre.kv, pre.rope_delta, pre.prompt_len, pre.first_token, sampling, prompt_ids=prompt)

    # a caller that stops after two tokens (a stop string): the core drops it and serves the next
    it = start()
    assert [int(await it.__anext__()), int(await it.__anext__())] == expected[:2]
    await it.aclose()
    assert [int(t) for t in await _decode(core, rid, pre, sampling, prompt)] == expected

    # an abort by request id ends its iterator early, without an error
    it = start()
    first = [int(await it.__anext__())]
    await core.abort(rid)
    got = first + [int(t) async for t in it]
    assert got == expected[:len(got)] and len(got) < len(expected)

    # the core killed mid-decode: that decode fails; the next one starts a new core
    starts, pid = core.starts, core.pid
    it = start()
    await it.__anext__()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineError, match="decode core exited"):
        async for _ in it:
            pass
    assert [int(t) for t in await _decode(core, rid, pre, sampling, prompt)] == expected
    assert core.starts == starts + 1 and core.pid not in (None, pid)

    # a fresh engine's first decode, before its core said Ready (the eos ids come with it): an
    # eos first token still ends the completion there
    fresh = CoreDecodeEngine(core._model_dir)
    await fresh.start()
    try:
        eos = min(core.eos_token_ids)
        assert [t async for t in fresh.decode(rid, pre.kv, pre.rope_delta, pre.prompt_len, eos, SAMPLINGS[0])] == []
        assert fresh.forwards == 0 and fresh.starts == 1
    finally:
        await fresh.stop()

    # stop: the core exits with the engine (the fixture's teardown stops it again: a no-op)
    pid = core.pid
    await core.stop()
    assert core.pid is None
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(pid, 0)
            await asyncio.sleep(0.05)


async def test_start_returns_before_the_core_is_ready_and_a_core_that_never_is_fails_each_wait(
        model_dir, tmp_path, monkeypatch):
    until = tmp_path / "exit-now"
    until.touch()  # tests/transport/silent_core.py: exits 3 at once, without a Ready
    monkeypatch.setattr(CoreDecodeEngine, "core_module", "tests.transport.silent_core")
    monkeypatch.setenv("SILENT_CORE_UNTIL", str(until))
    core = CoreDecodeEngine(model_dir)
    spawned = []
    spawn = core._spawn
    monkeypatch.setattr(core, "_spawn", lambda: (spawn(), spawned.append(core._proc.pid)))
    await core.start()  # the tokenizer loaded, the core spawned; no wait for its model
    assert core.tokenizer is not None and len(spawned) == 1
    for _ in range(2):  # each wait after a failed start tries a new core
        with pytest.raises(EngineError, match=r"did not start \(IncompleteReadError; exit code 3\)"):
            await core.started()
    assert core.starts == 0 and len(set(spawned)) == 2 and core.pid is None
    await core.stop()
