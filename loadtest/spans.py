"""Per-stage breakdown of fleet requests, from each request's terminal ``Finish`` event.

The fleet keeps every request's events in ``RedisKeys(prefix).token_stream(request_id)`` for
``stream_ttl_s`` (request_id = the response chunks' ``id``). A ``protocol.Finish`` carries
``spans``: per stage ``stage, worker, queue_ms`` (upstream produce → picked up), ``transfer_ms``,
``total_ms`` and ``compute_ms`` = total − transfer. Read them after a run, before the fleet
stops. ``inproc`` serves the same shape over HTTP (:func:`fetch_spans_http`). Degrades, never
fails: no spans or no Redis give ``{"available": False, "reason": ...}``.
Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from loadtest.metrics import summarize
from services.stages import STAGE_ORDER

FIELDS = ("queue_ms", "transfer_ms", "compute_ms", "total_ms")


async def fetch_spans(redis_url: str, prefix: str, request_ids: Iterable[str]) -> dict:
    """``{request_id: [span dict, ...]}`` for each request whose stream ends in a Finish, plus
    the reason when there is nothing to report. Returns ``{"spans": {...}, "reason": str|None}``."""
    import redis.asyncio as aioredis

    from shared import protocol
    from shared.keys import RedisKeys

    keys = RedisKeys(prefix)
    ids = [i for i in request_ids if i]
    out: dict[str, list[dict]] = {}
    client = aioredis.from_url(redis_url)
    try:
        async with client.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.xrevrange(keys.token_stream(rid), count=1)
            replies = await pipe.execute()
    except Exception as exc:  # noqa: BLE001 - any Redis failure means "no breakdown", said why
        return {"spans": {}, "reason": f"could not read token streams from {redis_url}: {exc!r}"}
    finally:
        await client.aclose()
    missing = 0
    for rid, entries in zip(ids, replies, strict=True):
        if not entries:
            missing += 1
            continue
        _entry_id, fields = entries[0]
        event = protocol.decode_event(fields[b"e"])
        if isinstance(event, protocol.Finish) and event.spans:
            out[rid] = [span_dict(s) for s in event.spans]
    reason = None
    if not out:
        reason = (f"no Finish event with spans among {len(ids)} requests"
                  + (f" ({missing} streams missing: expired, or another redis_prefix?)" if missing else ""))
    return {"spans": out, "reason": reason}


async def fetch_spans_http(url: str, request_ids: Iterable[str]) -> dict:
    """The same result as :func:`fetch_spans`, from a server that keeps its own spans
    (``POST url {"ids": [...]}`` → ``{id: [span dict, ...]}``)."""
    import aiohttp

    ids = [i for i in request_ids if i]
    try:
        async with aiohttp.ClientSession() as session, session.post(url, json={"ids": ids}) as resp:
            resp.raise_for_status()
            got = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return {"spans": {}, "reason": f"could not read spans from {url}: {exc!r}"}
    return {"spans": got, "reason": None if got else f"{url} had no spans for {len(ids)} requests"}


def span_dict(span) -> dict:
    """One ``StageSpan`` as a dict with every field of :data:`FIELDS` (compute: what is not transfer)."""
    compute = max(0.0, span.total_ms - span.transfer_ms)
    return {"stage": span.stage, "worker": span.worker, "queue_ms": span.queue_ms,
            "transfer_ms": span.transfer_ms, "compute_ms": compute, "total_ms": span.total_ms,
            **{f: getattr(span, f, 0.0) for f in ("claim_ms", "start_unix_ms", "first_out_ms")}}


def aggregate_spans(fetched: dict) -> dict:
    """Per stage: ``{n, <field>: {mean, p50, ...}}`` over requests, stages in pipeline order;
    ``per_request_ms``: queue / transfer / compute summed over stages, mean per request;
    ``biggest``: the largest mean queue or transfer part of one stage (the fleet's own cost).

    A request that went through a stage twice (a redelivery) counts each pass."""
    spans: dict[str, list[dict]] = fetched.get("spans", {})
    if not spans:
        return {"available": False, "reason": fetched.get("reason") or "no spans"}
    by_stage: dict[str, list[dict]] = {}
    for per_request in spans.values():
        for s in per_request:
            by_stage.setdefault(s["stage"], []).append(s)
    order = sorted(by_stage, key=lambda st: (STAGE_ORDER.index(st) if st in STAGE_ORDER else len(STAGE_ORDER), st))
    stages = {st: {"n": len(by_stage[st]), **{f: summarize(s[f] for s in by_stage[st]) for f in FIELDS}}
              for st in order}
    # what the fleet adds over one process is the hops (queue + transfer); compute is the
    # model's work either way, so the "biggest cost" named is the biggest hop part
    hops = [(stages[st][f]["mean"], st, f) for st in order for f in ("queue_ms", "transfer_ms")]
    biggest = max(hops)
    per_request = {f: sum(stages[st][f]["mean"] * stages[st]["n"] for st in order) / len(spans)
                   for f in ("queue_ms", "transfer_ms", "compute_ms")}
    return {"available": True, "requests": len(spans), "stages": stages, "per_request_ms": per_request,
            "biggest": {"stage": biggest[1], "part": biggest[2], "mean_ms": biggest[0]}}
