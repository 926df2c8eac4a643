"""The SGLang engine adapter against an in-memory fake of ``sglang.Engine``'s boundary (its
``async_generate(stream=True)`` chunks, ``tokenizer_manager.abort_request``, child pids): how
the adapter turns chunks into the fleet's token stream, stops on its own stop set, aborts what
it leaves early, resumes, and keeps SGLang on a loop of its own. It proves the adapter's
handling, not SGLang: that runs on a GPU only (loadtest/gpu_sglang_check.py)."""

from __future__ import annotations

import asyncio
import importlib.machinery
import sys
import threading
import types

import pytest

from shared import protocol
from shared.engines import sglang_config
from shared.engines.base import EngineError
from shared.engines.sglang_engine import SglangEngine


class FakeTokenizerManager:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.threads: set[str] = set()

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.threads.add(threading.current_thread().name)
        self.aborted.append(rid)


class FakeEngine:
    """Streams ``script`` (the completion, one token a chunk, cumulative as SGLang's default
    streaming is) for every request; records each request's arguments."""

    script: list[int] = [10, 11, 12, 13, 14, 15]
    instances: list[FakeEngine] = []

    def __init__(self, **server_args) -> None:
        self.server_args = server_args
        self.tokenizer_manager = FakeTokenizerManager()
        self.requests: list[dict] = []
        self.closed: list[str] = []
        self.loop_thread = threading.current_thread().name
        FakeEngine.instances.append(self)

    def get_all_child_pids(self) -> list[int]:
        return []

    async def async_generate(self, *, rid: str, stream: bool, input_ids, sampling_params, **rest):
        assert stream is True
        if len(input_ids) > 64:
            raise ValueError(f"The input ({len(input_ids)} tokens) is longer than the model's context length")
        self.requests.append({"rid": rid, "input_ids": list(input_ids), "sampling_params": sampling_params, **rest})
        return self._stream(rid, sampling_params["max_new_tokens"])

    async def _stream(self, rid: str, max_new: int):
        out: list[int] = []
        try:
            for token in self.script[:max_new]:
                out.append(token)
                done = len(out) == max_new
                yield {"output_ids": out, "meta_info": {"id": rid, "finish_reason": {"type": "length"} if done
                                                        else None}}
                await asyncio.sleep(0)
        finally:
            self.closed.append(rid)


@pytest.fixture
def fake_sglang(monkeypatch):
    module = types.ModuleType("sglang")
    module.__spec__ = importlib.machinery.ModuleSpec("sglang", None)
    module.Engine = FakeEngine
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(sglang_config, "startup_refusal", lambda device: None)  # no GPU here: the boundary only
    FakeEngine.instances.clear()
    return FakeEngine


def _engine(model_dir) -> SglangEngine:
    engine = SglangEngine(model_dir, device="cuda")
    engine.eos_token_ids = frozenset({13})
    return engine


async def _tokens(engine, rid, sampling, resume=()):
    return [t async for t in engine.generate(rid, [1, 2, 3], [], sampling, resume=resume)]


def test_chunks_become_the_token_stream_and_stop_at_eos(model_dir, fake_sglang):
    async def main():
        engine = _engine(model_dir)
        await engine.start()
        try:
            got = await _tokens(engine, "r1", protocol.Sampling(max_tokens=8, temperature=0.0))
            capped = await _tokens(engine, "r2", protocol.Sampling(max_tokens=2, temperature=0.0))
            past_eos = await _tokens(engine, "r3", protocol.Sampling(max_tokens=6, ignore_eos=True,
                                                                     stop_token_ids=(14,)))
        finally:
            await engine.stop()
        return got, capped, past_eos

    got, capped, past_eos = asyncio.run(main())
    assert got == [10, 11, 12, 13]  # eos included and last
    assert capped == [10, 11]
    assert past_eos == [10, 11, 12, 13, 14]  # eos ignored, the request's own stop token still ends it
    fake = fake_sglang.instances[0]
    assert fake.loop_thread == "sglang-loop" and fake.server_args["model_path"] == str(model_dir)
    first = fake.requests[0]
    assert first["input_ids"] == [1, 2, 3] and first["sampling_params"]["max_new_tokens"] == 8
    assert first["rid"].startswith("r1#")
    # left early on our stop set (r1 at eos, r3 past SGLang's ignore_eos): aborted; r2 ran to its end
    assert sorted(r.split("#")[0] for r in fake.tokenizer_manager.aborted) == ["r1", "r3"]
    assert fake.tokenizer_manager.threads == {"sglang-loop"}
    assert len(fake.closed) == 3


def test_a_stream_closed_early_aborts_its_request(model_dir, fake_sglang):
    async def main():
        engine = _engine(model_dir)
        await engine.start()
        try:
            stream = engine.generate("gone", [1], [], protocol.Sampling(max_tokens=6, ignore_eos=True))
            first = await stream.__anext__()
            await stream.aclose()
            await asyncio.sleep(0.05)
            return first, dict(engine._rids)
        finally:
            await engine.stop()

    first, in_flight = asyncio.run(main())
    fake = fake_sglang.instances[0]
    assert first == 10 and in_flight == {}
    assert [r.split("#")[0] for r in fake.tokenizer_manager.aborted] == ["gone"] and len(fake.closed) == 1


def test_resume_yields_the_earlier_tokens_then_continues_with_them_as_prompt(model_dir, fake_sglang):
    async def main():
        engine = _engine(model_dir)
        await engine.start()
        try:
            return await _tokens(engine, "again", protocol.Sampling(max_tokens=4, min_tokens=3, ignore_eos=True),
                                 resume=(10, 11))
        finally:
            await engine.stop()

    got = asyncio.run(main())
    req = fake_sglang.instances[0].requests[0]
    assert got == [10, 11, 10, 11]
    assert req["input_ids"] == [1, 2, 3, 10, 11]
    assert req["sampling_params"]["max_new_tokens"] == 2 and req["sampling_params"]["min_new_tokens"] == 1


def test_refusals_reach_the_caller_as_engine_errors(model_dir, fake_sglang):
    async def main():
        engine = _engine(model_dir)
        with pytest.raises(EngineError, match="sglang engine is not started"):
            await _tokens(engine, "early", protocol.Sampling())
        await engine.start()
        try:
            with pytest.raises(EngineError, match="sglang rejected the request: The input .* is longer"):
                [t async for t in engine.generate("long", list(range(100)), [], protocol.Sampling(max_tokens=1))]
            with pytest.raises(EngineError, match="does not serve structured output"):
                await _tokens(engine, "json", protocol.Sampling(structured=protocol.StructuredOutput("json_object")))
            with pytest.raises(EngineError, match="cannot prefill apart from decode"):
                await engine.prefill("p", [1], [], protocol.Sampling())
            assert engine._rids == {}
        finally:
            await engine.stop()
        assert engine._thread is None and engine._loop is None

    asyncio.run(main())


def test_start_refuses_without_sglang_or_a_gpu(model_dir, monkeypatch):
    monkeypatch.setattr(sglang_config, "startup_refusal", lambda device: "sglang is not installed: pip install ...")
    engine = SglangEngine(model_dir, device="cuda")
    with pytest.raises(EngineError, match="sglang is not installed"):
        asyncio.run(engine.start())
    assert engine._thread is None
