"""Which partition of ``mm.prefill`` a ``PrefillRequest`` goes to: every producer of one (the
gateway for text-only requests, the runner for any stage's output, restarts included) asks its
process's :class:`Router` at the produce point. Policies: ``kv`` (the live prefill worker whose
prefix cache holds most of the prompt's leading blocks, weighed against its load) or
``round_robin``. No table (Redis empty or unreachable, no live worker yet): ``None``, Kafka's own
key hashing. Routing never fails a request (after a rebalance the partition's new owner serves
the record; only the cache hit is lost), but for a ``redis_required`` router (the gateway's):
there an unavailable Redis raises, as the request's token stream could not be read either.

Design: docs/design/kv-routing.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis
from prometheus_client import Counter

from shared import protocol
from shared.keys import TOPIC_PREFILL, RedisKeys
from shared.kv.blocks import block_hashes
from shared.settings import Settings
from shared.transport.redis_conn import unavailable
from shared.transport.redis_lean import as_dict, lean_of

log = logging.getLogger(__name__)

ROUTING_DECISIONS = Counter("mmfleet_routing_decisions_total",
                            "Partition choices for mm.prefill records, by policy and reason "
                            "(kv_hit: a worker holding a prefix won; load: no worker held one; round_robin; "
                            "no_table: no live prefill worker known; error: the table was unreadable)",
                            ["policy", "reason"])
POLICIES = ("kv", "round_robin")
READ_AHEAD_MAX_AGE_S = 0.25  # older: read again at the produce point (loads move within seconds)
_READ_AHEAD_MAX = 256  # read-aheads kept at most (one per request in flight; the oldest go first)


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    partitions: tuple[int, ...]
    inflight: int
    queued_tokens: int
    overlap: int = 0  # leading request blocks it holds
    held: int = 0  # blocks its prefix cache holds (all sessions)


@dataclass(frozen=True)
class Decision:
    partition: int | None
    worker_id: str | None
    reason: str
    overlap: int = 0
    best: int = 0  # the most blocks any candidate held
    cost: float = 0.0
    load: float = 0.0  # the winner's load term (blocks queued)
    candidates: int = 0
    blocks: int = 0  # the prompt's whole blocks


class Router:
    """``kv`` policy: for each live prefill worker in the routing table (:mod:`shared.kv.table`),
    ``overlap`` = how many leading block hashes of the request (:mod:`shared.kv.blocks`) its
    prefix cache holds; cost = ``kv_overlap_weight`` x (prompt blocks - overlap) + blocks queued
    on it (its load). The cheapest worker wins; among equally cheap ones the one with the fewest
    requests in flight, then the fewest cached blocks (so new conversations spread over the
    workers instead of piling where ties happened to fall), then at random. The record goes to
    one of the partitions the winner owns. ``round_robin``: the next live worker in turn."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, settings: Settings,
                 placeholder_id: "int | frozenset[int]", *,
                 topic: str = TOPIC_PREFILL, rng: random.Random | None = None, redis_required: bool = False) -> None:
        if settings.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy {settings.routing_policy!r}: choose one of {', '.join(POLICIES)}")
        self._redis = redis
        self._redis_required = redis_required
        # the table read runs for every record routed: the lean client's (None: a router that only hashes, in tests)
        self._lean = lean_of(redis) if redis is not None else None
        self._keys = keys
        self.topic = topic
        self.policy = settings.routing_policy
        self._block_size = settings.kv_block_size
        self._weight = settings.kv_overlap_weight
        self._placeholder = placeholder_id
        self._rng = rng or random.Random()
        self._turn = itertools.count()
        self._owner_ids: list[str] = []  # the workers the owners map named last time (see workers())
        # request id -> (block hashes, when the read began, the read): see read_ahead()
        self._ahead: OrderedDict[str, tuple[list[int], float, asyncio.Task]] = OrderedDict()

    async def route(self, msg: protocol.PrefillRequest) -> tuple[int | None, protocol.PrefillRequest]:
        """The partition to produce ``msg`` to (None: key hashing) and ``msg`` carrying the
        decision (``route``) when a worker was picked, for the prefill's routing note. Never raises,
        but for an unavailable Redis when ``redis_required``."""
        try:
            decision = await self.decide(msg)
        except (aioredis.RedisError, OSError, ValueError) as exc:
            if self._redis_required and unavailable(exc):
                raise
            log.warning("routing table unreadable (%r); %s goes by key", exc, msg.meta.request_id)
            decision = Decision(None, None, "error")
        ROUTING_DECISIONS.labels(self.policy, decision.reason).inc()
        if decision.worker_id is None:
            return decision.partition, msg
        log.debug("route %s -> %s (overlap %d of %d blocks, best %d, load %.1f, %d candidates)",
                  msg.meta.request_id, decision.worker_id, decision.overlap, decision.blocks, decision.best,
                  decision.load, decision.candidates)
        note = protocol.RouteNote(policy=self.policy, worker=decision.worker_id, overlap=decision.overlap,
                                  best=decision.best, cost=round(decision.cost, 2), load=round(decision.load, 2),
                                  candidates=decision.candidates, blocks=decision.blocks,
                                  t_ms=int(time.time() * 1000))
        return decision.partition, msgspec.structs.replace(msg, route=note)

    def _hashes(self, prompt_ids: Sequence[int], items, salt: str = "") -> list[int]:
        return block_hashes(prompt_ids, items, placeholder_id=self._placeholder,
                            block_size=self._block_size, salt=salt) if self.policy == "kv" else []

    def read_ahead(self, request_id: str, prompt_ids: Sequence[int], items, salt: str = "") -> None:
        """Start reading the table for the ``PrefillRequest`` that ``request_id`` will produce
        (``items``: its media, anything with ``index``, ``mm_hash`` and ``n_tokens``). Never raises;
        a failed read is only a lost read-ahead. A stage that knows a request's prompt and media
        before it produces the request (encode, while its encoder runs) calls this; :meth:`decide`
        then uses what was read if it is at most ``READ_AHEAD_MAX_AGE_S`` old and for the same
        blocks, instead of a round trip at the produce point."""
        hashes = self._hashes(prompt_ids, items, salt)
        task = asyncio.create_task(self.workers(hashes), name="route-read-ahead")
        task.add_done_callback(_consume_error)
        old = self._ahead.pop(request_id, None)
        if old is not None:
            old[2].cancel()
        self._ahead[request_id] = (hashes, time.monotonic(), task)
        while len(self._ahead) > _READ_AHEAD_MAX:
            self._ahead.popitem(last=False)[1][2].cancel()

    async def _read_ahead_result(self, request_id: str, hashes: list[int]) -> list[WorkerView] | None:
        ahead = self._ahead.pop(request_id, None)
        if ahead is None:
            return None
        read_hashes, began, task = ahead
        if read_hashes != hashes or time.monotonic() - began > READ_AHEAD_MAX_AGE_S:
            task.cancel()
            return None
        try:  # (only an eviction cancels a read-ahead, and that removed it from _ahead)
            return await task
        except (aioredis.RedisError, OSError):
            return None  # read again, now

    async def decide(self, msg: protocol.PrefillRequest) -> Decision:
        hashes = self._hashes(msg.meta.prompt_token_ids, msg.items, msg.meta.cache_scope)
        workers = await self._read_ahead_result(msg.meta.request_id, hashes)
        if workers is None:
            workers = await self.workers(hashes)
        if not workers:
            return Decision(None, None, "no_table")
        if self.policy == "round_robin":
            w = workers[next(self._turn) % len(workers)]
            return Decision(self._rng.choice(w.partitions), w.worker_id, "round_robin",
                            candidates=len(workers), load=w.queued_tokens / self._block_size)
        costs = [(self._weight * (len(hashes) - w.overlap) + w.queued_tokens / self._block_size, w) for w in workers]
        best = min(c for c, _ in costs)
        tied = [w for c, w in costs if c == best]
        least = min((w.inflight, w.held) for w in tied)
        w = self._rng.choice([w for w in tied if (w.inflight, w.held) == least])
        return Decision(self._rng.choice(w.partitions), w.worker_id, "kv_hit" if w.overlap else "load", w.overlap,
                        best=max(x.overlap for x in workers), cost=best, load=w.queued_tokens / self._block_size,
                        candidates=len(workers), blocks=len(hashes))

    async def workers(self, hashes: list[int]) -> list[WorkerView]:
        """Live prefill workers that own partitions, sorted by id, with their overlap.

        One Redis round trip in the steady state: the owners map is read in the same pipeline as
        the load and blocks of the workers it named last time; only when it names others (a
        rebalance) is the pipeline sent again for them."""
        held = self.policy == "kv"  # the cached-block count only breaks kv's ties
        for _ in range(3):  # owners that change between two reads of them: a rebalance in progress
            ids = self._owner_ids
            cmds: list[tuple] = [("HGETALL", self._keys.kv_owners(self.topic))]
            for wid in ids:
                cmds.append(("HGETALL", self._keys.kv_load(wid)))
                if held:
                    cmds.append(("SCARD", self._keys.kv_blocks(wid)))
                if hashes:
                    cmds.append(("SMISMEMBER", self._keys.kv_blocks(wid), *hashes))
            owners, *replies = await self._lean.pipeline(cmds)
            by_worker: dict[str, list[int]] = {}
            for part, wid in as_dict(owners).items():
                by_worker.setdefault(wid.decode(), []).append(int(part))
            self._owner_ids = sorted(by_worker)
            if self._owner_ids == ids:
                break
        else:
            log.warning("the owners of %s kept changing while routing; using what was read last", self.topic)
        step = 1 + held + bool(hashes)
        out = []
        for i, wid in enumerate(ids):
            load = as_dict(replies[i * step])
            if not load or wid not in by_worker:
                continue  # not heard from within kv_report_ttl_ms: gone
            listed = {int(p) for p in load.get(b"partitions", b"").decode().split(",") if p}
            parts = tuple(sorted(p for p in by_worker[wid] if p in listed))  # both must agree
            if not parts:
                continue
            overlap = 0
            if hashes:
                for member in replies[i * step + 1 + held]:
                    if not member:
                        break
                    overlap += 1
            out.append(WorkerView(wid, parts, int(load.get(b"inflight", 0)), int(load.get(b"queued_tokens", 0)),
                                  overlap, held=int(replies[i * step + 1]) if held else 0))
        return out


def _consume_error(task: asyncio.Task) -> None:
    """A read-ahead nobody awaits (its request failed before producing) must not log
    "exception never retrieved"."""
    if not task.cancelled():
        task.exception()
