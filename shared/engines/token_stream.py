"""Turning an engine's token iterator into the request's stream events: one ``TokenDelta`` per
token (eos excluded; its text held back while it may start a stop string or end mid-character),
then one ``Finish``. A stop string ends generation (the iterator is closed) and is not sent.

Resume: the stream is the token log. A decode that runs again reads it (:func:`read_log`),
forces the logged tokens back into the engine and does not append their deltas again, so the
client sees each once; a log that vanished mid-request is written again whole. One append per
request is in flight at a time (in order); the iterator runs up to ``lookahead_tokens`` ahead.
Prefill writes the first delta (:func:`write_first_delta`). Design: docs/design/decode-core.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from shared import protocol, tracing
from shared.engines.base import SampledToken
from shared.engines.detok import IncrementalDetokenizer, StopChecker
from shared.engines.sampling import stop_token_set
from shared.stage import Context, EventSink, LogLost
from shared.tracing import path_so_far

log = logging.getLogger(__name__)

# Tokens prefill writes at most while their text is held back (an incomplete UTF-8 character,
# the start of a stop string): decode resumes after them as after a crash.
FIRST_TEXT_MAX_TOKENS = 8
# How far an in-process engine's decode may run ahead of the appends (stream_completion)
LOOKAHEAD_TOKENS = 2


@dataclass(frozen=True)
class LogState:
    done: bool  # a terminal event is already written
    tokens: tuple[int, ...]  # completion tokens already written, in order
    deltas: int  # TokenDelta entries already written


async def read_log(events: EventSink, request_id: str) -> LogState:
    history = await events.history(request_id)
    deltas = sorted((e for e in history if isinstance(e, protocol.TokenDelta)), key=lambda e: e.seq)
    done = any(isinstance(e, (protocol.Finish, protocol.ErrorEvent)) for e in history)
    state = LogState(done, tuple(t for d in deltas for t in d.token_ids), len(deltas))
    if state.done or state.deltas > 1:  # one delta: prefill's first token, the normal case
        # (a few: prefill's first tokens whose text was held back; more: an earlier attempt's)
        level = logging.INFO if state.done or state.deltas > FIRST_TEXT_MAX_TOKENS else logging.DEBUG
        log.log(level, "request %s: token log has %d deltas%s; %s", request_id, state.deltas,
                " and a terminal event" if done else "", "nothing to do" if done else "resuming after them")
    return state


def _delta(seq: int, token_ids: tuple[int, ...], text: str) -> protocol.TokenDelta:
    """The log entry of ``token_ids``: ids, or SampledToken ids carrying their logprob
    (requests with logprobs), whose logprobs go beside them."""
    return protocol.TokenDelta(seq=seq, token_ids=tuple(int(t) for t in token_ids), text=text,
                               logprobs=tuple(t.logprob for t in token_ids if isinstance(t, SampledToken)))


async def write_first_delta(events: EventSink, meta: protocol.RequestMeta, token: int, *, tokenizer,
                            eos_token_ids: frozenset[int],
                            more: Callable[[], AsyncIterator[int]] | None = None,
                            max_tokens: int = FIRST_TEXT_MAX_TOKENS) -> bool:
    """Append the request's delta 0 for its first sampled ``token``, exactly as
    :func:`stream_completion` would (nothing for a stop token: decode ends the request).
    Compare-and-append: False when the log already holds a delta 0 (an earlier attempt's).

    ``more`` (prefill where decode runs apart): when delta 0 carries no text yet, its text held
    back, the tokens after it (``more()``, the engine's decode from the same KV) are appended
    as deltas 1, 2, … until one carries text, a stop token or string, ``max_tokens`` tokens or
    the request's own ``max_tokens``: the client's first text then does not wait for the decode
    hop (a first token that is part of a character: ~1 request in 12 on the tiny model)."""
    stop_ids = stop_token_set(meta.sampling, eos_token_ids)
    if int(token) in stop_ids:
        return False
    detok, stops = IncrementalDetokenizer(tokenizer), StopChecker(meta.sampling.stop)
    res = stops.feed(detok.push(token))
    if not await events.append_delta(meta.request_id, _delta(0, (token,), res.emit), position=0):
        return False
    limit = min(max_tokens, meta.sampling.max_tokens)
    if not (res.emit or res.stopped or more is None or limit <= 1):
        tokens = more()
        try:
            seq = 1
            async for t in tokens:
                if int(t) in stop_ids:
                    break  # decode samples it again and ends the request
                res = stops.feed(detok.push(t))
                if not await events.append_delta(meta.request_id, _delta(seq, (t,), res.emit), position=seq):
                    break  # another attempt writes this log
                seq += 1
                if res.emit or res.stopped or seq >= limit:
                    break
        finally:
            await tokens.aclose()
    tracing.mark_first_output()
    return True


async def stream_completion(events: EventSink, meta: protocol.RequestMeta, tokens: AsyncIterator[int], *,
                            tokenizer, eos_token_ids: frozenset[int], prompt_len: int,
                            first_token: int | None = None, skip_deltas: int = 0, cached_tokens: int = 0,
                            aborted: Callable[[], Awaitable[bool]] | None = None,
                            abort_check_every: int = 16, lookahead_tokens: int = LOOKAHEAD_TOKENS) -> None:
    """``lookahead_tokens``: how far the engine may run ahead of the appends (0: in lock-step).
    ``aborted``: polled every ``abort_check_every`` tokens; true ends the request with an
    error event (the client went away; the engine stops when the iterator closes).

    Deltas are compare-and-appended at their sequence number: when another decode of the same
    request (a redelivery racing a live worker, a re-driven attempt) already wrote a position,
    this one stops without writing anything more, so the log holds each token once."""
    sampling = meta.sampling
    stop_ids = stop_token_set(sampling, eos_token_ids)  # eos unless ignore_eos, and stop_token_ids
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopChecker(sampling.stop)
    generated, reason = 0, "length"
    writer = _LogWriter(events, meta.request_id, skip_deltas)

    if lookahead_tokens > 0:
        tokens = _Ahead(tokens, lookahead_tokens)

    async def _all() -> AsyncIterator[int]:
        if first_token is not None:
            yield first_token
        async for t in tokens:
            yield t

    stream = _all()
    try:
        async for token in stream:
            generated += 1
            if token in stop_ids:
                reason = "stop"
                break
            res = stops.feed(detok.push(token))
            # one delta per token even without printable text yet: the log records every
            # token id, which is what a resumed decode continues from
            await writer.send(generated - 1, (token,), res.emit)
            if res.stopped:
                reason = "stop"
                break
            if generated >= sampling.max_tokens:
                break
            if aborted is not None and generated % abort_check_every == 0 and await aborted():
                await writer.settle()
                await events.append(meta.request_id, protocol.ErrorEvent(
                    status=499, type="invalid_request_error", message="the client closed the request",
                    code="client_closed_request"))
                return
        if not stops.stopped:
            res = stops.feed(detok.flush())
            tail = res.emit + ("" if res.stopped else stops.flush())
            reason = "stop" if res.stopped else reason
            if tail:
                await writer.send(generated, (), tail)
        await writer.settle()
    except _Superseded as sup:
        log.info("request %s: another decode already wrote delta %d of its token log; this one stops",
                 meta.request_id, sup.seq)
        return
    finally:
        writer.abandon()
        await stream.aclose()
        await tokens.aclose()
    usage = protocol.Usage(prompt_tokens=prompt_len, completion_tokens=generated, cached_tokens=cached_tokens)
    # at the log's next position too: a log flushed after the last delta is written again first
    writer.written.append(protocol.Finish(reason=reason, usage=usage, spans=path_so_far(meta)))
    if not await _append(meta.request_id, events, writer.written):
        log.info("request %s: another decode already finished its token log", meta.request_id)


class _LogWriter:
    """Appends one request's deltas to its token log in order. A sink that can queue an append
    without waiting (Redis's) gets each delta's append queued and its outcome read when the next
    delta goes out: the writer waits for the next token only, not for the call as well (one wake
    per token instead of two), and the sequences of a decode step append in the same script
    call. One append in flight at a time, so they stay in order."""

    def __init__(self, events: EventSink, request_id: str, skip_deltas: int) -> None:
        self._events, self._request_id, self._skip = events, request_id, skip_deltas
        self.written: list[protocol.StreamEvent] = []  # the whole log, skipped deltas too: a lost log is written again
        self._soon = getattr(events, "append_delta_soon", None)
        self._pending: list[tuple[asyncio.Future, int]] = []  # the append in flight: (future, position)

    async def settle(self) -> None:
        """The outcome of the append in flight, as ``_append`` would have given it."""
        if not self._pending:
            return
        fut, position = self._pending.pop()
        res = await fut  # done by now as a rule: a decode step takes longer than the call
        if res == 0 or (res == 2 and not await _append(self._request_id, self._events,
                                                       self.written[:position + 1], lost=True)):
            raise _Superseded(position)

    async def send(self, seq: int, token_ids: tuple[int, ...], text: str) -> None:
        written = self.written
        written.append(_delta(seq, token_ids, text))
        if len(written) > self._skip:  # the log already holds the first skip_deltas deltas
            await self.settle()
            position = len(written) - 1
            fut = self._soon(self._request_id, written[-1], position) if self._soon is not None else None
            if fut is not None:
                self._pending.append((fut, position))
            elif not await _append(self._request_id, self._events, written):
                raise _Superseded(position)
            if position == 0:
                await self.settle()  # the first output's time is when it is in the log
                tracing.mark_first_output()

    def abandon(self) -> None:
        """Left by an error: the append in flight's outcome no longer matters, nor its failure."""
        for fut, _ in self._pending:
            fut.add_done_callback(_discard)


_LOG_REWRITES = 3


def _discard(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: not logged as never retrieved


async def _append(request_id: str, events: EventSink, written: list[protocol.StreamEvent], *,
                  lost: bool = False) -> bool:
    """Append the last of ``written`` at its position; if the log is gone (Redis flushed, so
    deltas no reader had seen may be gone with it; ``lost``: known already), append the whole
    log again from position 0 first. False: another writer holds a position."""
    position = len(written) - 1
    start = 0 if lost else position
    if lost:
        log.warning("request %s: its token log is gone (Redis flushed?); writing its %d deltas again",
                    request_id, position + 1)
    for _ in range(_LOG_REWRITES + 1):
        try:
            for i in range(start, position + 1):
                if not await events.append_delta(request_id, written[i], position=i):
                    return False
            return True
        except LogLost:
            log.warning("request %s: its token log is gone (Redis flushed?); writing its %d deltas again",
                        request_id, position + 1)
            start = 0
    raise LogLost(f"the token log of {request_id} was lost {_LOG_REWRITES + 1} times while writing it")


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class _Ahead:
    """``tokens`` pulled by a task of its own, at most ``depth`` ahead of the reader, from the
    reader's first ``__anext__`` on (a completion that stops at its first token computes
    nothing more). ``aclose`` cancels the task and closes ``tokens``."""

    def __init__(self, tokens: AsyncIterator[int], depth: int) -> None:
        self._tokens = tokens
        self._queue: asyncio.Queue = asyncio.Queue(depth)
        self._task: asyncio.Task | None = None
        self._ended = False

    def __aiter__(self) -> "_Ahead":
        return self

    async def __anext__(self) -> int:
        if self._ended:
            raise StopAsyncIteration
        if self._task is None:
            self._task = asyncio.create_task(self._pull(), name="decode-lookahead")
        item = await self._queue.get()
        if item is _END or isinstance(item, _Failed):
            self._ended = True
            if item is _END:
                raise StopAsyncIteration
            raise item.exc
        return item

    async def _pull(self) -> None:
        try:
            async for token in self._tokens:
                await self._queue.put(token)
        except Exception as exc:  # noqa: BLE001 - the reader raises it, where it would have without look-ahead
            await self._queue.put(_Failed(exc))
            return
        await self._queue.put(_END)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._tokens.aclose()


class _Superseded(Exception):
    def __init__(self, seq: int) -> None:
        super().__init__(seq)
        self.seq = seq


def abort_check(ctx: Context, meta: protocol.RequestMeta) -> Callable[[], Awaitable[bool]] | None:
    """``stream_completion``'s ``aborted`` for a request: the gateway's abort key (None without a ledger)."""
    if ctx.ledger is None:
        return None
    return lambda: ctx.ledger.is_aborted(meta.request_id)
