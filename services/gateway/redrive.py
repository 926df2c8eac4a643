"""Re-drive unfinished requests after the broker lost its records.

Whoever restarts an in-memory broker (the supervisor) writes a fresh ``RedisKeys.broker_ready``
token once its topics exist. When the token changes, the gateway produces every request it is
still answering again from its source (entry message, inline media still in its pool) under a
fresh attempt: stages redo it (``StageLedger`` keys carry the attempt) and decode resumes from
the token log, so the client sees each token once, even for a request that then runs twice.
A durable broker (the compose cluster's Kafka) bumps no token: nothing is re-driven there.
Design: docs/guide/operations.md.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from shared import protocol
from shared.stage import entry_message
from shared.transport.bus import produce_entry
from shared.transport.ledger import EpochWatch, StageLedger

log = logging.getLogger(__name__)


class Redriver:
    """Tracks the requests the gateway is answering; re-drives them when the broker epoch changes.

    Bounded by the gateway's admission limit (one entry per in-flight request)."""

    def __init__(self, ledger: StageLedger, producer, *, poll_ms: int = 500, router=None, doorbell=None) -> None:
        self._ledger = ledger
        self._producer = producer
        self._router = router  # entries are routed like the gateway's (shared.transport.bus.produce_entry)
        self._doorbell = doorbell
        self._poll_s = poll_ms / 1000
        self._tracked: dict[str, protocol.RequestMeta] = {}
        self.redriven = 0  # requests produced again, for logs and tests

    def track(self, meta: protocol.RequestMeta) -> None:
        """``meta``: the request's entry-message meta (sources included)."""
        self._tracked[meta.request_id] = meta

    def forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    async def redrive(self, request_id: str) -> None:
        """Produce one tracked request again under a fresh attempt (its token log was lost after
        its decode finished: ``TokenStreams.follow``); errors are logged, the deadline still holds."""
        meta = self._tracked.get(request_id)
        if meta is None:
            return
        try:
            await self._redrive(meta)
        except Exception as exc:  # noqa: BLE001 - the request's own deadline ends it then
            log.warning("could not re-drive %s: %r", request_id, exc)

    async def run(self) -> None:
        """Poll the broker-ready token until cancelled. Redis errors only delay the check (a
        flushed Redis loses the token: the last one seen stays the reference)."""
        epoch = EpochWatch(self._ledger.broker_ready)
        while True:
            if await epoch.changed():
                log.warning("the broker was restarted and lost its records; re-driving %d requests",
                            len(self._tracked))
                await self._redrive_all()
            await asyncio.sleep(self._poll_s)

    async def _redrive_all(self) -> None:
        await asyncio.gather(*(self.redrive(request_id) for request_id in list(self._tracked)))

    async def _redrive(self, meta: protocol.RequestMeta) -> None:
        if meta.deadline_unix_ms <= time.time() * 1000:
            return  # its reader ends it with a 504
        attempt = await self._ledger.next_attempt(meta.request_id, meta.attempt)
        fresh = msgspec.structs.replace(meta, attempt=attempt)
        await produce_entry(self._producer, entry_message(fresh), deadline_unix_ms=meta.deadline_unix_ms,
                            router=self._router, doorbell=self._doorbell)
        if meta.request_id in self._tracked:
            self._tracked[meta.request_id] = fresh
        self.redriven += 1
