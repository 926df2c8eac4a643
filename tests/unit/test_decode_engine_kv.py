"""Decode of KV that stayed in the prefill worker's engine (``DecodeRequest.engine_kv``, vLLM),
with in-memory ports: the descriptor's wire form, the read-once rule (a second decode of one
attempt restarts the request instead of reading freed blocks), and the read that frees the
producer's blocks when the completion ends at its first token. The engine is a scripted fake
here; tests/engines/test_vllm_pd.py and tests/e2e/test_modes.py run the real vLLM pair."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from transformers import AutoTokenizer

from services.decode.handler import DecodeHandler
from shared import protocol
from shared.engines import vllm_pd
from shared.engines.base import Capabilities
from shared.stage import Context
from shared.transfer import OwnerGoneError
from tests.fakes import ListSink, MemoryTransfer

# what vLLM 0.32's NixlConnector returns for a finished kv_producer request (request_finished)
VLLM_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": ([3, 4],),
               "remote_engine_id": "e-1", "remote_request_id": "r", "remote_host": "127.0.0.1",
               "remote_port": 5601, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 140,
               "remote_blocks_expiry_time": None, "transfer_mode": "pull"}
MEDIA = [protocol.MediaShape("image", (1, 8, 8), 16)]


class MemoryLedger:
    def __init__(self) -> None:
        self.done: set[tuple[str, str, int]] = set()

    async def is_done(self, request_id: str, stage: str, attempt: int) -> bool:
        return (request_id, stage, attempt) in self.done

    async def mark_done(self, request_id: str, stage: str, attempt: int) -> None:
        self.done.add((request_id, stage, attempt))

    async def is_aborted(self, request_id: str) -> bool:
        return False


class ScriptedEngine:
    """``decode_remote`` yields ``resume`` then ``script`` (as the vLLM engine does); ``pullers``
    names the task that pulled each token."""

    capabilities = Capabilities(encode=False, generate=False, kv_export=False, kv_import=True, remote_kv=True)

    def __init__(self, tokenizer, script: list[int], eos: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset({eos})
        self.script = script
        self.calls: list[tuple[int, tuple[int, ...], int]] = []
        self.pullers: list[str] = []

    async def decode_remote(self, request_id, prompt_ids, kv, first_token, sampling, resume=()):
        assert isinstance(kv, protocol.EngineKv)
        self.calls.append((first_token, tuple(resume), sampling.max_tokens))
        for t in (*resume, *self.script)[: sampling.max_tokens - 1]:
            self.pullers.append(asyncio.current_task().get_name())
            yield t


class AheadEngine(ScriptedEngine):
    """Its tokens are computed in another process, queued here (as the decode core's are)."""

    capabilities = dataclasses.replace(ScriptedEngine.capabilities, decodes_ahead=True)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def message(first: int, max_tokens: int = 6, attempt: int = 0) -> protocol.DecodeRequest:
    now = int(time.time() * 1000)
    meta = protocol.RequestMeta(request_id="req-1", model="m", deadline_unix_ms=now + 60_000, created_unix_ms=now,
                                prompt_token_ids=(1, 2, 3), attempt=attempt,
                                sampling=protocol.Sampling(max_tokens=max_tokens, temperature=0.0))
    owner = protocol.AgentRef("prefill", b"")
    return protocol.DecodeRequest(meta=meta, owner=owner, kv=protocol.empty_tensor_ref(owner.name), prompt_len=140,
                                  rope_delta=0, first_token=first, engine_kv=vllm_pd.to_wire(VLLM_PARAMS, MEDIA))


def context(sink: ListSink, ledger: MemoryLedger) -> Context:
    return Context(stage="decode", worker_id="d", events=sink, transfer=MemoryTransfer("d"), ledger=ledger)


def test_descriptor_survives_the_wire_and_returns_as_vllm_params():
    kv = vllm_pd.to_wire(VLLM_PARAMS, MEDIA)
    msg = message(first=5)
    back = protocol.decoder_for(protocol.DecodeRequest).decode(protocol.encode(msg))
    assert back.engine_kv == kv and back.engine_kv.media == tuple(MEDIA)
    params = vllm_pd.from_wire(back.engine_kv)
    expected = {k: v for k, v in VLLM_PARAMS.items() if k != "remote_blocks_expiry_time"}
    assert {**params, "remote_block_ids": tuple(params["remote_block_ids"])} == expected
    # a record written before engine_kv existed still decodes (new fields have defaults)
    old = protocol.encode(msgspec_replace(msg, engine_kv=None))
    assert protocol.decoder_for(protocol.DecodeRequest).decode(old).engine_kv is None
    with pytest.raises(ValueError):
        vllm_pd.to_wire({"remote_block_ids": []}, [])


def msgspec_replace(msg, **changes):
    import msgspec

    return msgspec.structs.replace(msg, **changes)


async def test_reads_once_per_attempt(tokenizer):
    eos = tokenizer.eos_token_id
    engine = ScriptedEngine(tokenizer, [11, 12, 13, 14, 15], eos)
    ledger, sink = MemoryLedger(), ListSink()
    out = await DecodeHandler(engine).handle(message(first=10), context(sink, ledger))
    assert out.releases == []  # nothing in a pool: the engine read the KV
    assert engine.calls == [(10, (), 6)]
    deltas = [e for e in sink.events["req-1"] if isinstance(e, protocol.TokenDelta)]
    assert [t for d in deltas for t in d.token_ids] == [10, 11, 12, 13, 14, 15]
    # the same attempt decoded again with its log unfinished (fresh sink): the producer freed
    # the blocks at the first read, so this must restart the request, not read again
    with pytest.raises(OwnerGoneError):
        await DecodeHandler(engine).handle(message(first=10), context(ListSink(), ledger))
    assert len(engine.calls) == 1
    # a restarted attempt reads its own, fresh KV
    await DecodeHandler(engine).handle(message(first=10, attempt=1), context(ListSink(), ledger))
    assert len(engine.calls) == 2


async def test_first_token_eos_still_reads_so_the_producer_frees(tokenizer):
    eos = tokenizer.eos_token_id
    engine = ScriptedEngine(tokenizer, [11], eos)
    sink = ListSink()
    await DecodeHandler(engine).handle(message(first=eos), context(sink, MemoryLedger()))
    assert engine.calls == [(eos, (), 1)]  # one read, its token discarded
    assert isinstance(sink.events["req-1"][-1], protocol.Finish)


async def test_an_engine_that_decodes_ahead_gets_no_look_ahead_task(tokenizer):
    """The writer's look-ahead task pulls an in-process engine's tokens while an append is in
    flight; an engine whose tokens already queue up from another process (the decode core) is
    pulled by the handler itself: one task and one queue less per token."""
    eos = tokenizer.eos_token_id
    for engine_class, pulled_by_lookahead in ((ScriptedEngine, True), (AheadEngine, False)):
        engine = engine_class(tokenizer, [11, 12, 13, 14, 15], eos)
        sink = ListSink()
        await DecodeHandler(engine).handle(message(first=10), context(sink, MemoryLedger()))
        deltas = [e for e in sink.events["req-1"] if isinstance(e, protocol.TokenDelta)]
        assert [t for d in deltas for t in d.token_ids] == [10, 11, 12, 13, 14, 15]
        assert len(engine.pullers) == 5
        assert all((name == "decode-lookahead") == pulled_by_lookahead for name in engine.pullers), engine.pullers
