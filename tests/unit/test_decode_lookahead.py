"""The decode writer's look-ahead (``services.decode.stream``): the engine's next step runs
while a token's append is in flight, at most ``lookahead_tokens`` ahead; the tokens already
pulled when a delta is written go in that delta (at most ``max_delta_tokens``); the log holds
the same tokens and text as in lock-step; a resumed decode groups the logged tokens as the log
does; a stop string closes the engine's iterator; an engine failure reaches the caller."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from services.decode.stream import read_log, stream_completion
from shared import protocol
from shared.engines.detok import IncrementalDetokenizer
from tests.fakes import ListSink, log_content

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


async def _run(sink, tok, engine, meta, lookahead, **kw):
    await stream_completion(sink, meta, engine.tokens(), tokenizer=tok, eos_token_ids=frozenset({EOS}),
                            prompt_len=1, lookahead_tokens=lookahead, **kw)



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
    assert log_content(sink.events["r"]) == log_content(lockstep.events["r"])
    assert all(len(e.token_ids) == 1 for e in lockstep.events["r"][:-1])  # lock-step: nothing is ever ready ahead


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
    assert log_content(ahead.events["r"]) == log_content(lockstep.events["r"])
    assert isinstance(ahead.events["r"][-1], protocol.Finish) and ahead.events["r"][-1].reason == "stop"


async def test_engine_failure_reaches_the_caller_after_the_tokens_before_it(tok):
    ids = _ids(tok)
    sink = ListSink()
    engine = _Engine(ids, fail_at=5)
    with pytest.raises(RuntimeError, match="engine step failed"):
        await _run(sink, tok, engine, _meta(max_tokens=len(ids)), 2)
    assert engine.closed
    assert [t for d in sink.events["r"] for t in d.token_ids] == ids[:5]


class _SlowSink(ListSink):
    """Appends take a few loop turns (a Redis round trip), so the engine runs ahead of them."""

    async def append_delta(self, request_id, delta, position):
        for _ in range(6):
            await asyncio.sleep(0)
        return await super().append_delta(request_id, delta, position)


@pytest.mark.parametrize("most", [3, 16])
async def test_a_delta_carries_the_tokens_pulled_while_the_append_before_it_was_in_flight(tok, most):
    ids = _ids(tok)
    slow, lockstep = _SlowSink(), ListSink()
    await _run(slow, tok, _Engine(ids), _meta(max_tokens=len(ids)), 8, max_delta_tokens=most)
    await _run(lockstep, tok, _Engine(ids), _meta(max_tokens=len(ids)), 0)
    sizes = [len(e.token_ids) for e in slow.events["r"][:-1]]
    assert max(sizes) > 1 and max(sizes) <= most  # fewer appends for the same tokens
    assert len(sizes) < len(ids)
    deltas = slow.events["r"][:-1]
    assert [d.seq for d in deltas] == [sum(sizes[:i]) for i in range(len(sizes))]  # seq: its first token's index
    assert log_content(slow.events["r"]) == log_content(lockstep.events["r"])
    assert slow.events["r"][-1].usage.completion_tokens == len(ids)


async def test_a_resumed_decode_groups_the_logged_tokens_as_the_log_does(tok):
    """An earlier attempt logged 1 + 3 + 2 tokens and died; this one gets every token at once
    (grouped freely it would write them as one delta) and must skip exactly the logged deltas."""
    ids = _ids(tok)
    whole = ListSink()
    await _run(whole, tok, _Engine(ids), _meta(max_tokens=len(ids)), 0)
    sink = _SlowSink()
    cut, at, detok = [1, 3, 2], 0, IncrementalDetokenizer(tok)
    for position, n in enumerate(cut):
        group = tuple(ids[at:at + n])
        text = "".join(detok.push(t) for t in group)
        assert await sink.append_delta("r", protocol.TokenDelta(seq=at, token_ids=group, text=text), position)
        at += n
    log = await read_log(sink, "r")
    assert log.sizes == (1, 3, 2) and log.tokens == tuple(ids[:6])

    class _Eager(_Engine):  # the forced tokens come back without a pause, as a resumed engine gives them
        async def tokens(self):
            for t in self.ids:
                yield t

    await _run(sink, tok, _Eager(ids[1:]), _meta(max_tokens=len(ids)), 8, first_token=log.tokens[0],
               logged=log.sizes)
    events = sink.events["r"]
    assert [len(e.token_ids) for e in events[:3]] == cut  # the earlier attempt's deltas, untouched
    assert log_content(events) == log_content(whole.events["r"])  # each token once, the text as in one go
