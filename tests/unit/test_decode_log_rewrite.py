"""A token log flushed away mid-request (Redis FLUSHALL) takes with it the deltas no reader has
read yet: the decode writer notices at its next append (the log's counter is gone past position
0) and writes the whole log again from position 0, prefill's first delta included; readers drop
the positions they already have (tests/transport/test_token_log.py)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from shared import protocol
from shared.engines.token_stream import stream_completion
from tests.fakes import ListSink, QueuedAppends
from tests.unit.test_decode_lookahead import EOS, _Engine, _ids, _meta


class _FlushingSink(ListSink):
    """The log is flushed right after delta ``at`` is written, before anyone read it."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.flushed = at, False

    async def append_delta(self, request_id, delta, position):
        ok = await super().append_delta(request_id, delta, position)
        if ok and position == self.at and not self.flushed:
            self.flushed = True
            self.flush(request_id)
        return ok


class _QueuedFlushingSink(QueuedAppends, _FlushingSink):
    """The same, its appends queued without waiting (Redis's sink): the loss is seen a token later."""


def _flushing(queued: bool, at: int) -> _FlushingSink:
    return (_QueuedFlushingSink if queued else _FlushingSink)(at)


@pytest.fixture
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


async def _complete(sink, tok, ids, **kw):
    await stream_completion(sink, _meta(max_tokens=len(ids)), _Engine(kw.pop("engine_ids", ids)).tokens(),
                            tokenizer=tok, eos_token_ids=frozenset({EOS}), prompt_len=1, **kw)


@pytest.mark.parametrize("queued", [False, True])
@pytest.mark.parametrize("lookahead", [0, 2])
async def test_a_log_flushed_mid_request_is_written_again_whole(tok, lookahead, queued):
    ids = _ids(tok)
    whole = ListSink()
    await _complete(whole, tok, ids, lookahead_tokens=lookahead)
    sink = _flushing(queued, at=3)
    await _complete(sink, tok, ids, lookahead_tokens=lookahead)
    assert sink.flushed
    assert sink.events["r"] == whole.events["r"]  # every delta in order, then Finish


@pytest.mark.parametrize("queued", [False, True])
async def test_the_rewrite_includes_the_deltas_prefill_wrote(tok, queued):
    ids = _ids(tok)
    whole = ListSink()
    await _complete(whole, tok, ids)
    sink = _flushing(queued, at=2)
    sink.events["r"] = [whole.events["r"][0]]  # prefill's delta 0
    await _complete(sink, tok, ids, engine_ids=ids[1:], first_token=ids[0], skip_deltas=1)
    assert sink.flushed
    assert sink.events["r"] == whole.events["r"]
    assert isinstance(sink.events["r"][-1], protocol.Finish)


@pytest.mark.parametrize("queued", [False, True])
async def test_a_log_flushed_after_its_last_delta_is_written_again_before_the_finish(tok, queued):
    ids = _ids(tok)
    whole = ListSink()
    await _complete(whole, tok, ids)
    deltas = sum(isinstance(e, protocol.TokenDelta) for e in whole.events["r"])
    sink = _flushing(queued, at=deltas - 1)  # nothing is appended after it but the Finish
    await _complete(sink, tok, ids)
    assert sink.flushed
    assert sink.events["r"] == whole.events["r"]
