"""One delivery of a stage record, the one object the runner works on: the record Kafka
delivered (:class:`Delivered`), or, with early start, the copy a doorbell ring carried
(:class:`shared.transport.early.EarlyRun`). A delivery takes the stage's claim its own way
(:meth:`Delivery.enter`), confirms itself (:meth:`Delivery.confirmed`: the Kafka record, once it
is there) and gates what may be emitted before then (:meth:`Delivery.gate`), so the runner has one
path for both and nothing of early start runs where there is none. Design: docs/design/runner.md.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiokafka import TopicPartition

from shared import protocol
from shared.transport.ledger import StageLedger


class Unconfirmed(Exception):
    """The delivery will not be confirmed: Kafka did not deliver an early-started record in time,
    or its partition went away."""


class Delivery(Protocol):
    sent_unix_ms: int  # when the record was produced (its queue time starts there)

    async def enter(self, ledger: StageLedger, stage: str, meta: protocol.RequestMeta, worker_id: str,
                    topic: str) -> int:
        """Take the stage's claim on the record; the ledger's state (``CLAIMED``, ``DONE``, ...)."""

    def gate(self, events: Any) -> Any:
        """``events`` (an EventSink) whose writes wait until they may be seen."""

    async def confirmed(self) -> tuple[TopicPartition, Any]:
        """``(tp, rec)`` of the record in Kafka, the claim held; every effect others see awaits it."""

    async def claimed(self) -> None:
        """Returns once the claim is held (before a retry); raises :class:`Unconfirmed` if not."""

    async def holds_claim(self) -> bool:
        """Whether the claim is this delivery's (for the release at the end)."""


class Delivered:
    """A record Kafka delivered: its claim waits for a live holder's end, and it is confirmed
    already, so nothing is gated."""

    def __init__(self, tp: TopicPartition, rec: Any) -> None:
        self.tp, self.rec = tp, rec
        self.sent_unix_ms = rec.timestamp

    async def enter(self, ledger: StageLedger, stage: str, meta: protocol.RequestMeta, worker_id: str,
                    topic: str) -> int:
        # past the deadline an unclaimed record goes on: the deadline check ends it with a 504
        return await ledger.enter_waiting(meta.request_id, stage, meta.attempt, worker_id,
                                          give_up_unix_ms=meta.deadline_unix_ms, poll_s=0.2)

    def gate(self, events: Any) -> Any:
        return events

    async def confirmed(self) -> tuple[TopicPartition, Any]:
        return self.tp, self.rec

    async def claimed(self) -> None:
        return None

    async def holds_claim(self) -> bool:
        return True
