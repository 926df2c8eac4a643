"""Per-stage timing of a request, carried along in ``RequestMeta.spans``.

The runner opens a :class:`SpanTimer` (in a context variable) around each handler call; handlers
mark their transfer time with ``with timed_transfer():``; the runner stamps the finished span onto
every message the handler produced, and the stage that ends the request puts the whole path into
its ``Finish`` event. Context variables follow the handler's task, so requests never mix timers.

Design: docs/guide/observability.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import msgspec

from shared import protocol

_current: ContextVar[SpanTimer | None] = ContextVar("mmfleet_span", default=None)


class SpanTimer:
    def __init__(self, stage: str, worker: str, queue_ms: float, claim_ms: float = 0.0) -> None:
        self.stage = stage
        self.worker = worker
        self.queue_ms = max(queue_ms, 0.0)
        self.claim_ms = claim_ms
        self.transfer_s = 0.0
        self.first_out_ms = 0.0
        self._start_unix_ms = time.time() * 1000
        self._t0 = time.perf_counter()

    def mark_first_output(self) -> None:
        if not self.first_out_ms:
            self.first_out_ms = (time.perf_counter() - self._t0) * 1000

    def span(self) -> protocol.StageSpan:
        return protocol.StageSpan(stage=self.stage, worker=self.worker, queue_ms=round(self.queue_ms, 3),
                                  transfer_ms=round(self.transfer_s * 1000, 3),
                                  total_ms=round((time.perf_counter() - self._t0) * 1000, 3),
                                  claim_ms=round(self.claim_ms, 3), start_unix_ms=round(self._start_unix_ms, 3),
                                  first_out_ms=round(self.first_out_ms, 3))


@contextmanager
def stage_span(stage: str, worker: str, queue_ms: float, claim_ms: float = 0.0) -> Iterator[SpanTimer]:
    timer = SpanTimer(stage, worker, queue_ms, claim_ms)
    token = _current.set(timer)
    try:
        yield timer
    finally:
        _current.reset(token)


@contextmanager
def timed_transfer() -> Iterator[None]:
    timer = _current.get()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if timer is not None:
            timer.transfer_s += time.perf_counter() - t0


def mark_first_output() -> None:
    """The current stage just wrote its request's first token (TTFT breakdown)."""
    timer = _current.get()
    if timer is not None:
        timer.mark_first_output()


def path_so_far(meta: protocol.RequestMeta) -> tuple[protocol.StageSpan, ...]:
    """The request's spans including the current stage's (so far), for a terminal event."""
    timer = _current.get()
    return meta.spans + ((timer.span(),) if timer is not None else ())


def stamp(value: msgspec.Struct, span: protocol.StageSpan) -> msgspec.Struct:
    """``value`` (a stage message) with ``span`` appended to its ``meta.spans``."""
    meta = value.meta
    return msgspec.structs.replace(value, meta=msgspec.structs.replace(meta, spans=meta.spans + (span,)))
