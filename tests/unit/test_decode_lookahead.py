"""The decode writer's look-ahead (``shared.engines.token_stream``): the engine's next step runs
while a token's append is in flight, at most ``lookahead_tokens`` ahead; the log is the same
as in lock-step; a stop string closes the engine's iterator; an engine failure reaches the
caller. With a sink that queues appends (Redis's), the writer takes the next token before the
last append's answer, one append in flight, and still stops where another writer holds a position."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from shared import protocol
from shared.engines.token_stream import stream_completion
from tests.fakes import ListSink, SoonSink

EOS = 2


def _meta(**sampling) -> protocol.RequestMeta:
    return protocol.RequestMeta(request_id="r", model="m", deadline_unix_ms=1, created_unix_ms=0,
                                prompt_token_ids=(1,), sampling=protocol.Sampling(**sampling))


class _Engine:
    """An engine's token iterator that records how far it was pulled and whether it was closed."""

    def __init__(self, ids, fail_at: int | None = None) -> None:
        self.ids = list(ids)
        self.fail_at = fail_at
        self.pulled = 0
        self.closed = False

    async def tokens(self):
        try:
            for i, t in enumerate(self.ids):
                if i == self.fail_at:
                    raise RuntimeError("engine step failed")
                await asyncio.sleep(0)
                self.pulled += 1
                yield t
        finally:
            self.closed = True


class _GatedSink(ListSink):
    """Appends wait for ``gate``: a Redis round trip that has not come back yet."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.pulled_at_first_append: int | None = None
        self.engine: _Engine | None = None

    async def append_delta(self, request_id, delta, position):
        if position == 1 and self.pulled_at_first_append is None:
            for _ in range(20):  # let the look-ahead task run while this append waits
                await asyncio.sleep(0)
            self.pulled_at_first_append = self.engine.pulled
            self.gate.set()
        if position >= 1:
            await self.gate.wait()
        return await super().append_delta(request_id, delta, position)


@pytest.fixture
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _ids(tok):
    return tok.encode(" the sea is blue and calm today under a bright sky", add_special_tokens=False)


async def _run(sink, tok, engine, meta, lookahead):
    await stream_completion(sink, meta, engine.tokens(), tokenizer=tok, eos_token_ids=frozenset({EOS}),
                            prompt_len=1,
                            lookahead_tokens=lookahead)


@pytest.mark.parametrize("lookahead", [1, 2, 4])
async def test_engine_runs_ahead_of_a_pending_append_by_at_most_the_lookahead(tok, lookahead):
    ids = _ids(tok)
    sink = _GatedSink()
    sink.engine = engine = _Engine(ids)
    await _run(sink, tok, engine, _meta(max_tokens=len(ids)), lookahead)
    # while delta 1 (token 2) was being appended the engine had produced token 2 and at most
    # `lookahead` more (one may sit in the puller's hand, blocked on the full queue)
    assert 2 < sink.pulled_at_first_append <= 2 + lookahead + 1
    lockstep = ListSink()
    await _run(lockstep, tok, _Engine(ids), _meta(max_tokens=len(ids)), 0)
    assert sink.events["r"] == lockstep.events["r"]


async def test_lockstep_never_pulls_ahead(tok):
    ids = _ids(tok)
    sink = _GatedSink()
    sink.engine = engine = _Engine(ids)
    await _run(sink, tok, engine, _meta(max_tokens=len(ids)), 0)
    assert sink.pulled_at_first_append == 2


async def test_stop_string_closes_the_engine_and_writes_nothing_after_it(tok):
    ids = _ids(tok)
    stop = tok.decode(ids[:4])[-3:]  # ends inside the fourth token
    meta = _meta(max_tokens=len(ids), stop=(stop,))
    ahead, lockstep = ListSink(), ListSink()
    engine = _Engine(ids)
    await _run(ahead, tok, engine, meta, 4)
    await _run(lockstep, tok, _Engine(ids), meta, 0)
    assert engine.closed
    assert engine.pulled < len(ids)  # it stopped, not ran to the end
    assert ahead.events["r"] == lockstep.events["r"]
    assert isinstance(ahead.events["r"][-1], protocol.Finish) and ahead.events["r"][-1].reason == "stop"


async def test_engine_failure_reaches_the_caller_after_the_tokens_before_it(tok):
    ids = _ids(tok)
    sink = ListSink()
    engine = _Engine(ids, fail_at=5)
    with pytest.raises(RuntimeError, match="engine step failed"):
        await _run(sink, tok, engine, _meta(max_tokens=len(ids)), 2)
    assert engine.closed
    assert [d.token_ids for d in sink.events["r"]] == [(t,) for t in ids[:5]]


class _SlowSoonSink(SoonSink):
    """Queued appends answered a few loop turns later; records how far the engine was pulled
    when each position was applied."""

    def __init__(self, engine: _Engine) -> None:
        super().__init__()
        self.engine = engine
        self.pulled_at: dict[int, int] = {}

    async def append_delta(self, request_id, delta, position):
        for _ in range(5):
            await asyncio.sleep(0)
        self.pulled_at[position] = self.engine.pulled
        return await super().append_delta(request_id, delta, position)


@pytest.mark.parametrize("lookahead", [0, 2])
async def test_queued_appends_let_the_writer_take_the_next_token_and_keep_the_log(tok, lookahead):
    ids = _ids(tok)
    engine = _Engine(ids)
    sink = _SlowSoonSink(engine)
    await _run(sink, tok, engine, _meta(max_tokens=len(ids)), lookahead)
    lockstep = ListSink()
    await _run(lockstep, tok, _Engine(ids), _meta(max_tokens=len(ids)), 0)
    assert sink.events["r"] == lockstep.events["r"]
    deltas = sum(isinstance(e, protocol.TokenDelta) for e in lockstep.events["r"])
    assert sink.queued == deltas  # every delta went through the queue; the Finish is awaited
    assert sink.in_flight_max == 1  # one at a time: two could reach Redis out of order
    # delta 1 (token 2) was still unanswered when the writer had taken token 3 from the engine
    # (in lock-step the engine stands at 2 then: test_lockstep_never_pulls_ahead)
    assert sink.pulled_at[1] >= 3


@pytest.mark.parametrize("sink_class", [ListSink, SoonSink])
async def test_a_writer_behind_another_stops_at_the_position_it_holds(tok, sink_class):
    """A redelivered decode racing a live one: the log already holds positions 0-2 of the other
    writer; this one (which read delta 0 only) writes nothing, and closes its engine."""
    ids = _ids(tok)
    sink = sink_class()
    other = [protocol.TokenDelta(seq=i, token_ids=(ids[i],), text=f"other{i}") for i in range(3)]
    sink.events["r"] = list(other)
    engine = _Engine(ids[1:])
    await stream_completion(sink, _meta(max_tokens=len(ids)), engine.tokens(), tokenizer=tok,
                            eos_token_ids=frozenset({EOS}), prompt_len=1, first_token=ids[0], skip_deltas=1,
                            lookahead_tokens=0)
    assert sink.events["r"] == other
    assert engine.closed and engine.pulled < len(ids) - 1
