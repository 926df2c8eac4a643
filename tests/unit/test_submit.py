"""``mmfleet submit``'s file handling without a broker: input parsing, resumption, and folding
reply records (including a reply sequence that starts again after a redelivery)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import pytest

from services.submit import SubmitResult, _take, answered_ids, default_reply_topic, read_requests


@dataclass
class Rec:
    key: bytes
    value: bytes
    headers: list


def rec(rid: str, body: dict, kind: str, seq: int, last: bool, status: int = 200) -> Rec:
    return Rec(rid.encode(), json.dumps(body).encode(),
               [("mmfleet-kind", kind.encode()), ("mmfleet-seq", str(seq).encode()),
                ("mmfleet-last", b"1" if last else b"0"), ("mmfleet-status", str(status).encode())])


def test_read_requests_endpoints_and_errors(tmp_path):
    src = tmp_path / "my batch.jsonl"
    src.write_text('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"x": 1}}\n\n'
                   '{"custom_id": "b", "url": "/v1/completions", "body": {"y": 2}}\n'
                   '{"custom_id": 3, "body": {}}\n')
    assert [(r, e) for r, e, _ in read_requests(src)] == [("a", "chat.completions"), ("b", "completions"),
                                                         ("3", "chat.completions")]
    assert default_reply_topic(src) == "mm.replies.my_batch"
    src.write_text('{"custom_id": "a", "body": {}}\n{"custom_id": "a", "body": {}}\n')
    with pytest.raises(ValueError, match=":2: custom_id 'a' appears twice"):
        read_requests(src)
    src.write_text('{"body": {}}\n')
    with pytest.raises(ValueError, match=":1:"):
        read_requests(src)


def test_answered_ids_ignores_a_line_cut_short(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a", "response": {}}\n{"custom_id": "b", "resp')
    assert answered_ids(out) == {"a"}
    assert answered_ids(tmp_path / "missing.jsonl") == set()


def test_take_folds_streams_and_restarts():
    wanted, result, out = {"s", "w", "e"}, SubmitResult(), io.StringIO()
    assert not _take(rec("other", {}, "completion", 0, True), wanted, result, out)  # not ours
    assert not _take(rec("s", {"n": 0}, "chunk", 0, False), wanted, result, out)
    assert not _take(rec("s", {"n": 1}, "chunk", 1, False), wanted, result, out)
    assert not _take(rec("s", {"n": 0}, "chunk", 0, False), wanted, result, out)  # redelivered: starts again
    assert _take(rec("s", {"n": 1}, "chunk", 1, True), wanted, result, out)
    assert _take(rec("w", {"object": "chat.completion"}, "completion", 0, True), wanted, result, out)
    err = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
    assert _take(rec("e", err, "error", 0, True, status=400), wanted, result, out)
    lines = {d["custom_id"]: d for d in map(json.loads, out.getvalue().splitlines())}
    assert lines["s"]["response"]["body"] == [{"n": 0}, {"n": 1}]
    assert lines["w"]["response"] == {"status_code": 200, "body": {"object": "chat.completion"}}
    assert lines["e"]["response"]["status_code"] == 400 and lines["e"]["error"]["message"] == "bad"
    assert (result.written, result.errors, wanted) == (3, 1, set())
