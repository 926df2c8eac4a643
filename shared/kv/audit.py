"""Why a routed request did or did not reuse KV: one note per prefill, written by the worker that
ran it, and the lag of KV events into the routing table. The router's decision travels in the
record (``PrefillRequest.route``, a ``RouteNote``); the prefill worker writes it to
``kv_route(request_id)`` as a ``RouteOutcome`` with ``ran_on``, ``hit`` and ``cause``
(:func:`classify`), and
``TableWriter`` pushes each cache change's lag to the bounded list ``kv_event_lags``. Notes are
advisory: their writes run beside the request, in the table writer's pipeline, and failures are
logged, not raised.

Design: docs/design/kv-routing.md.
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec
import redis.asyncio as aioredis
from prometheus_client import Counter, Histogram

from shared import protocol
from shared.keys import RedisKeys

log = logging.getLogger(__name__)

NOTE_TTL_S = 600
LAG_SAMPLES = 2000
MAX_PENDING = 256  # notes waiting for a write per process; beyond it notes are dropped
CAUSES = ("hit", "cold", "load", "evicted", "moved", "unrouted")

_ENCODE = msgspec.json.Encoder().encode
_DECODE = msgspec.json.Decoder(protocol.RouteOutcome).decode

PREFIX_OUTCOMES = Counter("mmfleet_prefix_outcomes_total",
                          "Routed prefills by what their prefix reuse met: " + ", ".join(CAUSES), ["cause"])
EVENT_LAG = Histogram("mmfleet_kv_event_lag_seconds", "A prefill worker's cache change to its routing-table write",
                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))


def classify(note: protocol.RouteNote | None, ran_on: str, hit: int) -> str:
    """The cause of one routed prefill's reuse: ``hit`` (reused at least what the table promised),
    ``cold`` (no worker listed any block: a first turn, or the previous turn's blocks not in the
    table yet), ``load`` (another worker held more, the load term outweighed it), ``evicted`` (the
    table listed blocks the winner's cache no longer had), ``moved`` (the record ran on another
    worker than routed to: a rebalance), ``unrouted`` (no decision: no table, or unreadable)."""
    if note is None:
        return "unrouted"
    if note.worker != ran_on:
        return "moved"
    overlap, best = note.overlap, note.best
    if hit >= overlap and (hit > 0 or best == 0):
        return "hit" if hit > 0 else "cold"
    if hit < overlap:
        return "evicted"
    return "load"  # the winner held nothing, another worker held ``best`` blocks


class NoteWriter(Protocol):
    """Where notes go: the worker's :class:`~shared.kv.table.TableWriter` (which imports this module)."""

    def note(self, key: str, value: bytes) -> bool: ...

    async def flush(self, timeout_s: float = 5.0) -> bool: ...


class RouteAudit:
    """Writes the notes of one prefill worker, through its :class:`~shared.kv.table.TableWriter`
    (one pipeline with the worker's table changes, not a round trip a note). A note is one JSON
    value, a ``protocol.RouteOutcome`` (``NOTE_TTL_S``), not a hash: ~24 arguments fewer to pack
    a request."""

    def __init__(self, writer: NoteWriter, keys: RedisKeys) -> None:
        self._writer = writer
        self._keys = keys

    def prefilled(self, msg: protocol.PrefillRequest, ran_on: str, hit_blocks: int) -> None:
        note, request_id = msg.route, msg.meta.request_id
        cause = classify(note, ran_on, hit_blocks)
        PREFIX_OUTCOMES.labels(cause).inc()
        outcome = protocol.RouteOutcome(route=note, ran_on=ran_on, hit=hit_blocks, cause=cause)
        if not self._writer.note(self._keys.kv_route(request_id), _ENCODE(outcome)):
            log.debug("kv audit: note for %s dropped (%d waiting)", request_id, MAX_PENDING)

    async def drain(self) -> None:
        """Wait for the notes queued so far to be written (tests, shutdown)."""
        await self._writer.flush()


def lag_ops(keys: RedisKeys, lags_ms: list[float]) -> list[tuple]:
    """The commands that record the lag samples of one table write (in the table writer's pipeline)."""
    if not lags_ms:
        return []
    for lag in lags_ms:
        EVENT_LAG.observe(lag / 1000)
    return [("LPUSH", keys.kv_event_lags(), *(f"{lag:.1f}" for lag in lags_ms)),
            ("LTRIM", keys.kv_event_lags(), 0, LAG_SAMPLES - 1)]


async def read_notes(redis_url: str, prefix: str, request_ids: list[str]) -> dict[str, protocol.RouteOutcome]:
    """The notes of ``request_ids`` (missing ones omitted), for benchmarks."""
    r = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(prefix)
    try:
        pipe = r.pipeline(transaction=False)
        for rid in request_ids:
            pipe.get(keys.kv_route(rid))
        replies = await pipe.execute()
    finally:
        await r.aclose()
    return {rid: _DECODE(raw) for rid, raw in zip(request_ids, replies, strict=True) if raw}


async def read_lags(redis_url: str, prefix: str) -> list[float]:
    r = aioredis.Redis.from_url(redis_url)
    try:
        return [float(x) for x in await r.lrange(RedisKeys(prefix).kv_event_lags(), 0, -1)]
    finally:
        await r.aclose()
