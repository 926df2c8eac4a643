"""Why a routed request did or did not reuse KV: one note per prefill, written by the worker that
ran it, and the lag of KV events into the routing table.

Contract:
- The router's decision travels in the record (``PrefillRequest.route``, a ``RouteNote``):
  ``policy``, ``worker`` (the winner), ``overlap`` (blocks the table said the winner held),
  ``best`` (the most any candidate held), ``cost`` / ``load`` of the winner (cost units:
  blocks), ``candidates``, ``blocks`` (the prompt's whole blocks), ``t_ms``.
- The prefill worker writes ``kv_route(request_id)`` (a hash, ``NOTE_TTL_S``) in the background,
  in one round trip: those fields, ``ran_on``, ``hit`` (blocks its prefix cache gave) and ``cause``
  (:func:`classify`): ``hit`` (reused at least what the table promised), ``cold`` (no worker
  listed any block: a first turn, or the previous turn's blocks not in the table yet), ``load``
  (another worker held more, the load term outweighed it), ``evicted`` (the table listed blocks
  the winner's cache no longer had: evicted before the removal reached the table, or after the
  decision), ``moved`` (the record ran on another worker than routed to: a rebalance),
  ``unrouted`` (no decision: no table, or the table was unreadable).
- ``KvTableUpdater`` pushes each applied event's lag (now − the record's produce timestamp) to
  the bounded list ``kv_event_lags`` (newest first, ``LAG_SAMPLES`` kept).
Notes are advisory: their writes run beside the request (never on its path) and failures are
logged, not raised.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import redis.asyncio as aioredis
from prometheus_client import Counter, Histogram

from shared import protocol
from shared.keys import RedisKeys

log = logging.getLogger(__name__)

NOTE_TTL_S = 600
LAG_SAMPLES = 2000
MAX_PENDING = 256  # background note writes in flight per process; beyond it notes are dropped
CAUSES = ("hit", "cold", "load", "evicted", "moved", "unrouted")

PREFIX_OUTCOMES = Counter("mmfleet_prefix_outcomes_total",
                          "Routed prefills by what their prefix reuse met: " + ", ".join(CAUSES), ["cause"])
EVENT_LAG = Histogram("mmfleet_kv_event_lag_seconds", "mm.kv-events produce to routing-table update",
                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))


def classify(note: protocol.RouteNote | None, ran_on: str, hit: int) -> str:
    """The cause of one routed prefill's reuse (see the module contract)."""
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


class RouteAudit:
    """Writes and completes the notes of one process (router side and prefill side)."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys
        self._pending: set[asyncio.Task] = set()

    def _soon(self, coro) -> None:
        if len(self._pending) >= MAX_PENDING:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def prefilled(self, msg: protocol.PrefillRequest, ran_on: str, hit_blocks: int) -> None:
        self._soon(self._write(msg.meta.request_id, msg.route, ran_on, hit_blocks))

    async def _write(self, request_id: str, note: protocol.RouteNote | None, ran_on: str, hit: int) -> None:
        cause = classify(note, ran_on, hit)
        PREFIX_OUTCOMES.labels(cause).inc()
        fields = {} if note is None else {k: str(v) for k, v in msgspec.structs.asdict(note).items()}
        key = self._keys.kv_route(request_id)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hset(key, mapping={**fields, "ran_on": ran_on, "hit": str(hit), "cause": cause})
            pipe.expire(key, NOTE_TTL_S)
            await pipe.execute()
        except (aioredis.RedisError, OSError) as exc:
            log.debug("kv audit: note for %s not written: %r", request_id, exc)

    async def drain(self) -> None:
        """Wait for the writes in flight (tests, shutdown)."""
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)


def lag_ops(pipe, keys: RedisKeys, lags_ms: list[float]) -> None:
    """Queue the lag samples of one applied batch on ``pipe`` (the table updater's pipeline)."""
    if not lags_ms:
        return
    for lag in lags_ms:
        EVENT_LAG.observe(lag / 1000)
    pipe.lpush(keys.kv_event_lags(), *(f"{lag:.1f}" for lag in lags_ms))
    pipe.ltrim(keys.kv_event_lags(), 0, LAG_SAMPLES - 1)


async def read_notes(redis_url: str, prefix: str, request_ids: list[str]) -> dict[str, dict[str, str]]:
    """The notes of ``request_ids`` (missing ones omitted), for benchmarks."""
    r = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(prefix)
    try:
        pipe = r.pipeline(transaction=False)
        for rid in request_ids:
            pipe.hgetall(keys.kv_route(rid))
        replies = await pipe.execute()
    finally:
        await r.aclose()
    return {rid: {k.decode(): v.decode() for k, v in raw.items()}
            for rid, raw in zip(request_ids, replies, strict=True) if raw}


async def read_lags(redis_url: str, prefix: str) -> list[float]:
    r = aioredis.Redis.from_url(redis_url)
    try:
        return [float(x) for x in await r.lrange(RedisKeys(prefix).kv_event_lags(), 0, -1)]
    finally:
        await r.aclose()
