"""Prefill writes a request's first delta (``shared.engines.token_stream.write_first_delta``) and
decode resumes after it: the log must be exactly the one decode alone would have written, for
plain tokens, logprobs, a stop string held back or hit, and an end-of-sequence first token."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from shared import protocol
from shared.engines.base import SampledToken
from shared.engines.token_stream import read_log, stream_completion, write_first_delta
from tests.fakes import ListSink

EOS = 2


def _meta(**sampling) -> protocol.RequestMeta:
    return protocol.RequestMeta(request_id="r", model="m", deadline_unix_ms=1, created_unix_ms=0,
                                prompt_token_ids=(1,), sampling=protocol.Sampling(**sampling))


async def _decode(sink: ListSink, meta, tok, first, rest) -> None:
    """What decode does: read the log, resume after what it holds, stream the rest."""
    log = await read_log(sink, "r")

    async def tokens():
        for t in rest:
            yield t

    await stream_completion(sink, meta, tokens(), tokenizer=tok, eos_token_ids=frozenset({EOS}), prompt_len=1,
                            first_token=log.tokens[0] if log.tokens else first, skip_deltas=log.deltas)


@pytest.mark.parametrize("case", ["plain", "logprobs", "stop string", "stop held back", "eos first", "one token"])
async def test_prefill_first_delta_then_decode_equals_decode_alone(model_dir, case):
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(" the sea is blue and calm today", add_special_tokens=False)
    first, rest = ids[0], ids[1:]
    kw = {"max_tokens": 16}
    if case == "logprobs":
        kw["logprobs"] = 1
        first = SampledToken(protocol.TokenLogprob(ids[0], -0.5, ((ids[0], -0.5),)))
    elif case == "stop string":
        kw["stop"] = (tok.decode(ids[:1]).strip(),)  # the first token's own text
    elif case == "stop held back":
        kw["stop"] = (tok.decode(ids[:2]).strip() + "zz",)  # starts like it, never completes
    elif case == "eos first":
        first = EOS
    elif case == "one token":
        kw["max_tokens"] = 1
    meta = _meta(**kw)
    alone, split = ListSink(), ListSink()
    await _decode(alone, meta, tok, first, rest)
    wrote = await write_first_delta(split, meta, first, tokenizer=tok, eos_token_ids=frozenset({EOS}))
    assert wrote is (case != "eos first")  # a stop token gets no delta: decode ends the request
    await _decode(split, meta, tok, first, rest)
    assert split.events["r"] == alone.events["r"]
    # a second prefill attempt finds delta 0 written and writes nothing
    assert not await write_first_delta(split, meta, first, tokenizer=tok, eos_token_ids=frozenset({EOS}))


def _more(tokens):
    """The engine's decode from prefill's KV, as ``more`` gets it: tokens 2.. of the completion."""
    closed = []

    def more():
        async def gen():
            try:
                for t in tokens:
                    yield t
            finally:
                closed.append(True)
        return gen()
    return more, closed


@pytest.mark.parametrize("case", ["emoji", "emoji capped", "emoji then eos", "stop held back", "max_tokens 2", "plain"])
async def test_prefill_writes_until_text_shows_then_decode_equals_decode_alone(model_dir, case):
    """A first token whose text is held back (part of a character, the start of a stop string):
    prefill appends the next tokens too until one shows text, and the log decode finishes is
    the one decode alone writes."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(" 🙂 the sea is calm", add_special_tokens=False)  # the emoji: 3 byte tokens, text on the 3rd
    assert tok.decode(ids[:1]).strip("\ufffd ") == "" and "🙂" in tok.decode(ids[:3])
    kw, cap, expect_deltas = {"max_tokens": 16}, 8, 3
    if case == "emoji capped":
        cap, expect_deltas = 2, 2
    elif case == "emoji then eos":
        ids = ids[:1] + [EOS]
        expect_deltas = 1  # the stop token is decode's to sample again: it ends the request
    elif case == "stop held back":
        ids = tok.encode(" the sea is calm", add_special_tokens=False)
        kw["stop"] = (tok.decode(ids[:2]) + "zz",)  # held until the third token shows it is not one
        expect_deltas = 3
    elif case == "max_tokens 2":
        kw["max_tokens"], expect_deltas = 2, 2
    elif case == "plain":
        ids = tok.encode(" the sea is calm", add_special_tokens=False)
        expect_deltas = 1
    first, rest = ids[0], ids[1:]
    meta = _meta(**kw)
    alone, split = ListSink(), ListSink()
    await _decode(alone, meta, tok, first, rest)
    more, closed = _more(rest)
    assert await write_first_delta(split, meta, first, tokenizer=tok, eos_token_ids=frozenset({EOS}), more=more,
                                   max_tokens=cap)
    log = await read_log(split, "r")
    assert log.deltas == expect_deltas
    assert closed == ([True] if expect_deltas > 1 or case == "emoji then eos" else [])  # the engine's decode ends
    if case in ("emoji", "stop held back"):
        assert split.events["r"][-1].text  # the last one prefill wrote shows text
        assert not any(e.text for e in split.events["r"][:-1])
    await _decode(split, meta, tok, first, rest)
    assert split.events["r"] == alone.events["r"]
