"""The contract between a stage's pure handler and the one generic runner. A stage is ``async
handle(msg, ctx) -> Outcome``: it reads one decoded message, works through the ports in ``ctx``
(tensor transfer, token streams) and returns what to produce; it never touches Kafka. The runner
produces the outcome, waits for the ack, releases the upstream leases in ``Outcome.releases``,
and only then commits. ``RequestFailed``: the request cannot succeed (bad input, unsupported,
deadline): its ``ErrorEvent`` is written and the record committed. Any other exception is a
fault: retried up to ``max_attempts``, then dead-lettered with a terminal error for the client.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from msgspec import Struct

from shared import protocol
from shared.keys import TOPIC_MEDIA_FETCH, TOPIC_PREFILL

if TYPE_CHECKING:
    from contextlib import AsyncExitStack
    from pathlib import Path

    from redis.asyncio import Redis

    from shared.engines.base import Engine
    from shared.keys import RedisKeys
    from shared.settings import Settings
    from shared.transfer import TransferAgent
    from shared.transport.ledger import StageLedger


@dataclass(frozen=True)
class Produce:
    """One record to produce: topic, key (request_id, or mm_hash on the encode topic), value.
    ``partition``: None lets the producer choose (the router for ``mm.prefill``, else the key)."""

    topic: str
    key: str
    value: Struct
    partition: int | None = None


def entry_message(meta: protocol.RequestMeta) -> Produce:
    """Where a request enters the fleet: media-fetch when it has media (``meta.sources``),
    prefill otherwise. The gateway sends it first; a restart from the source sends it again."""
    if meta.sources:
        msg = protocol.MediaFetchRequest(meta=meta, items=meta.sources, owner=meta.source_owner)
        return Produce(TOPIC_MEDIA_FETCH, meta.request_id, msg)
    return Produce(TOPIC_PREFILL, meta.request_id, protocol.PrefillRequest(meta=meta))


@dataclass
class Outcome:
    produce: list[Produce] = field(default_factory=list)
    # (owner agent, lease ids) to release once ``produce`` is acknowledged by the broker
    releases: list[tuple[protocol.AgentRef, list[int]]] = field(default_factory=list)


class RequestFailed(Exception):
    """Terminal, user-visible failure of one request."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.event = protocol.ErrorEvent(status=status, type=type_, message=message, param=param, code=code)

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> RequestFailed:
        return cls(400, message, param=param, code=code)

    @classmethod
    def deadline(cls, request_id: str, stage: str) -> RequestFailed:
        return cls(504, f"request {request_id} passed its deadline in stage {stage}",
                   type_="timeout_error", code="deadline_exceeded")


class LogLost(Exception):
    """The request's token log is gone (Redis flushed) while its writer is past position 0: the
    writer appends its log again from position 0 (readers drop the positions they have), so a
    delta written and flushed before anyone read it is not lost."""


class EventSink(Protocol):
    """Where token-stream events go (Redis in production, a list in handler tests). A sink may
    also offer ``append_delta_if(request_id, delta, position, guard) -> bool | None`` (Redis's
    does): ``append_delta`` only if the store shows ``guard`` met, None if not (``shared.transport.early``);
    and ``append_delta_soon(request_id, delta, position) -> asyncio.Future | None``: the append
    queued without waiting for it, its future's result 1 appended, 0 another writer has the
    position, 2 the log is gone; None: not now (await ``append_delta``)."""

    async def append(self, request_id: str, event: protocol.StreamEvent) -> None: ...

    async def history(self, request_id: str) -> list[protocol.StreamEvent]:
        """Every event written for the request so far, in order."""
        ...

    async def append_delta(self, request_id: str, delta: protocol.StreamEvent, position: int) -> bool:
        """Append ``delta`` (a ``TokenDelta``, or the ``Finish`` after the last one) as the log's
        ``position``-th entry, only if that is the next one;
        False: another decode of the request wrote that position first. Raises
        :class:`LogLost` when the log is gone (Redis flushed) and ``position`` is past 0."""
        ...


@dataclass
class Context:
    """Ports a handler may use. ``transfer`` is None in stages that move no tensors."""

    stage: str
    worker_id: str
    events: EventSink
    transfer: TransferAgent | None = None
    ledger: StageLedger | None = None  # None: no idempotency claims (handler tests)


class Handler(Protocol):
    async def handle(self, msg: Struct, ctx: Context) -> Outcome: ...


# ---------------------------------------------------------------------- stage specs
@dataclass(frozen=True)
class StageParts:
    """What a worker process hands every stage it runs when building its handler."""

    settings: Settings
    model_dir: Path
    stages: tuple[str, ...]  # every stage this worker runs (a layout may change how one is built)
    stack: AsyncExitStack  # register cleanups here: they run when the worker stops
    engine: Callable[[str], Awaitable[Engine]]  # the process's one started engine of a kind
    redis: Redis
    keys: RedisKeys
    transfer: TransferAgent
    worker_id: str
    router: Any  # shared.kv.router.Router of the process
    index: Any = None  # shared.embcache.index.EmbeddingIndex, None with the embedding cache off
    doorbell: Any = None  # shared.transport.doorbell.Doorbell of the process, None with the doorbell off


@dataclass(frozen=True)
class StageBuild:
    """A built stage: its handler, and what else it runs beside its runner."""

    handler: Handler
    concurrency: int | None = None  # records in flight for its runner (None: ``stage_concurrency``)
    listener: Any = None  # an aiokafka ConsumerRebalanceListener for its runner's consumer
    background: tuple[Callable[[], Awaitable[None]], ...] = ()  # run beside, cancelled at the end


@dataclass(frozen=True)
class StageSpec:
    """One stage, declared once in ``services/<stage>/spec.py`` and listed in ``services/stages.py``;
    the worker, the modes, the supervisor and the CLI derive everything from these."""

    name: str
    topic: str  # the topic it consumes (``shared.keys``)
    message: object  # the type (or union) decoded from ``topic``
    produces: tuple[str, ...]  # topics its handler produces to (documentation and a registry check)
    part: str  # which letter of a mode name (``e``, ``p``, ``d``) places it: see ``services.modes``
    build: Callable[[StageParts], Awaitable[StageBuild]]
    upstream: str | None = None  # the stage whose output is its ONLY input (None: work also enters here)
