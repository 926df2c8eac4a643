"""Incremental detokenizer and stop strings, on the tiny model's byte-level BPE."""

from __future__ import annotations

import pytest

from shared.engines.detok import IncrementalDetokenizer, StopChecker, find_stop, partial_stop_len
from shared.models import tokenizer_build as tb


@pytest.fixture(scope="module")
def tokenizer():
    return tb.build_qwen2_tokenizer(seed=0)


def stream(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", ["héllo wörld 日本", "漢字 and 🚀 rockets — ça va?", "plain ascii text"])
def test_round_trip_token_by_token(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_char_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer("漢", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1, "expected an unmerged CJK char to span several byte tokens"
    deltas = stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "漢" and deltas[-1] == ""


def test_special_tokens_skipped(tokenizer):
    ids = (
        tokenizer("hi", add_special_tokens=False)["input_ids"]
        + [tokenizer.convert_tokens_to_ids(tb.IM_END)]
        + tokenizer(" there", add_special_tokens=False)["input_ids"]
    )
    assert "".join(stream(tokenizer, ids)) == "hi there"


def test_flush_releases_incomplete_bytes(tokenizer):
    ids = tokenizer("ok 漢", add_special_tokens=False)["input_ids"][:-1]
    detok = IncrementalDetokenizer(tokenizer)
    pushed = "".join(detok.push(i) for i in ids)
    assert "\ufffd" not in pushed and pushed.startswith("ok")
    tail = detok.flush()
    assert tail.endswith("\ufffd") and pushed + tail == tokenizer.decode(ids)


# ---- stop strings -----------------------------------------------------------------


def test_find_stop_and_partial():
    assert find_stop("abc STOP def", ["STOP"]) == (4, "STOP")
    assert find_stop("xab", ["b", "ab"]) == (1, "ab")
    assert find_stop("nothing", ["STOP", ""]) is None
    assert partial_stop_len("abc ST", ["STOP"]) == 2
    assert partial_stop_len("abc", ["STOP"]) == 0


def test_stop_cut_within_one_delta():
    sc = StopChecker(["STOP"])
    r = sc.feed("hello STOP world")
    assert (r.emit, r.stopped, r.matched) == ("hello ", True, "STOP")


def test_stop_split_across_deltas_is_held_then_cut():
    sc = StopChecker(["STOP"])
    assert sc.feed("hello S").emit == "hello "
    assert sc.feed("T").emit == ""
    r = sc.feed("OP tail")
    assert (r.emit, r.stopped) == ("", True)


def test_partial_match_released_when_resolved_or_flushed():
    sc = StopChecker(["STOP", "\n\n"])
    out = [sc.feed("go ST").emit, sc.feed("ART now\n").emit]
    assert out == ["go ", "START now"]
    assert sc.flush() == "\n"
    assert not sc.stopped


def test_detok_and_stop_together(tokenizer):
    ids = tokenizer("héllo wörld. END of 日本", add_special_tokens=False)["input_ids"]
    detok, sc = IncrementalDetokenizer(tokenizer), StopChecker(["END"])
    emitted = ""
    for i in ids:
        r = sc.feed(detok.push(i))
        emitted += r.emit
        if r.stopped:
            break
    assert sc.stopped and emitted == "héllo wörld. "
