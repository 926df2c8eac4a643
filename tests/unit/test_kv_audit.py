"""shared.kv.audit.classify: why a routed prefill did or did not reuse KV."""

from __future__ import annotations

import msgspec
import pytest

from shared.kv.audit import CAUSES, classify
from shared.protocol import RouteNote

NOTE = RouteNote(policy="kv", worker="w1", overlap=3, best=3)


def note(**kw) -> RouteNote:
    return msgspec.structs.replace(NOTE, **kw)


@pytest.mark.parametrize(("note", "ran_on", "hit", "cause"), [
    (NOTE, "w1", 3, "hit"),
    (NOTE, "w1", 5, "hit"),  # the cache held more than the table knew (events still on their way)
    (note(overlap=0, best=0), "w1", 2, "hit"),
    (note(overlap=0, best=0), "w1", 0, "cold"),
    (note(overlap=0, best=4), "w1", 0, "load"),
    (NOTE, "w1", 1, "evicted"),  # listed, gone (partly) by the time prefill ran
    (NOTE, "w1", 0, "evicted"),
    (NOTE, "w2", 3, "moved"),  # the partition changed hands after the decision
    (None, "w1", 0, "unrouted"),
])
def test_classify(note, ran_on, hit, cause):
    assert classify(note, ran_on, hit) == cause
    assert cause in CAUSES


def test_kv_bench_reports_follow_up_causes_and_event_lag(tmp_path):
    from types import SimpleNamespace

    from loadtest import kvbench

    specs = [SimpleNamespace(turn=t) for t in (0, 1, 1, 1)]
    causes = [{"cause": "cold"}, {"cause": "hit"}, {"cause": "evicted"}, None]

    def rec(i):
        return {"index": i, "status": 200, "error": None, "prompt_tokens": 100, "cached_tokens": 64 * (i == 1),
                "ttft_ms": 10.0 + i, "route": causes[i],
                "spans": [{"stage": "encode", "total_ms": 3.0, "transfer_ms": 0.0},
                          {"stage": "prefill", "total_ms": 5.0 + i, "transfer_ms": 1.0}]}

    s = kvbench.summarize([rec(i) for i in range(4)], specs, [5.0, 7.0, 30.0])
    assert s["causes_followups"] == {"hit": 1, "evicted": 1, "unrouted": 1}  # the first turn is no follow-up
    assert s["kv_event_lag_ms"]["max"] == 30.0 and s["kv_event_lag_ms"]["p50"] == 7.0
    assert s["prefill_share_followups"] == 0.5  # median of 5/11, 6/12, 7/13: prefill less transfers
    result = {"config": {}, "policies": {"kv": s}, "runs": [], "goals": kvbench.goals({"kv": s})}
    text = kvbench.write(result, tmp_path, plots=False).read_text()
    assert "| kv | 1 | 0 | 0 | 1 | 0 | 1 | 7.0 / " in text
