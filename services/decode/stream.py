"""Turning an engine's token iterator into the request's stream events.

Contract: one ``TokenDelta`` per generated token (eos excluded), each carrying the token id
and the text it completes (held back while it may still be the start of a stop string or an
incomplete UTF-8 character), then one ``Finish`` with the reason and usage. A stop string
ends generation early (the iterator is closed, which aborts the request in the engine) and is
not itself sent, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from shared import protocol
from shared.engines.detok import IncrementalDetokenizer, StopChecker
from shared.stage import EventSink
from shared.tracing import path_so_far


async def stream_completion(events: EventSink, meta: protocol.RequestMeta, tokens: AsyncIterator[int], *,
                            tokenizer, eos_token_ids: frozenset[int], prompt_len: int,
                            first_token: int | None = None) -> None:
    sampling = meta.sampling
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopChecker(sampling.stop)
    generated, reason = 0, "length"

    async def _send(seq: int, token_ids: tuple[int, ...], text: str) -> None:
        await events.append(meta.request_id, protocol.TokenDelta(seq=seq, token_ids=token_ids, text=text))

    async def _all() -> AsyncIterator[int]:
        if first_token is not None:
            yield first_token
        async for t in tokens:
            yield t

    stream = _all()
    try:
        async for token in stream:
            generated += 1
            if token in eos_token_ids:
                reason = "stop"
                break
            res = stops.feed(detok.push(token))
            # one delta per token even without printable text yet: the log records every
            # token id, which is what a resumed decode continues from
            await _send(generated - 1, (token,), res.emit)
            if res.stopped:
                reason = "stop"
                break
            if generated >= sampling.max_tokens:
                break
    finally:
        await stream.aclose()
        await tokens.aclose()
    if not stops.stopped:
        res = stops.feed(detok.flush())
        tail = res.emit + ("" if res.stopped else stops.flush())
        reason = "stop" if res.stopped else reason
        if tail:
            await _send(generated, (), tail)
    usage = protocol.Usage(prompt_tokens=prompt_len, completion_tokens=generated)
    await events.append(meta.request_id, protocol.Finish(reason=reason, usage=usage, spans=path_so_far(meta)))
