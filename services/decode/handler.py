"""decode (apart from prefill): generate and write token deltas to the request's Redis stream as
they come. (Prefill and decode in one worker: ``services.prefill.generate``.)

``DecodeHandler``: in ``DecodeRequest``; pulls the KV cache over NIXL, continues after the first
token and releases prefill's KV slot at the end. With ``engine_kv`` (vLLM) the engine reads the
KV from prefill's engine itself, once per attempt (the producer frees the blocks when read): a
decode that runs again for the same attempt restarts the request from its source. It first
reads the token log: a finished request is not generated again, a partial one resumes.
Design: docs/design/decode-core.md.
"""

from __future__ import annotations

import msgspec

from shared import protocol
from shared.engines.base import Engine, SampledToken
from shared.engines.token_stream import LOOKAHEAD_TOKENS, abort_check, read_log, stream_completion
from shared.stage import Context, Outcome
from shared.tracing import timed_transfer
from shared.transfer import OwnerGoneError


class DecodeHandler:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def handle(self, msg: protocol.DecodeRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        meta = msg.meta
        done = Outcome(releases=[(msg.owner, [msg.kv.lease])] if msg.kv.lease else [])
        log = await read_log(ctx.events, meta.request_id)
        if log.done:
            return done
        first = log.tokens[0] if log.tokens else msg.first_token
        if not log.tokens and msg.first_logprob is not None:  # the stream writer records it with the token
            first = SampledToken(msg.first_logprob)
        started = None
        if msg.engine_kv is not None:
            await _read_once(ctx, meta)
            started = _Started(self._engine.decode_remote(meta.request_id, list(meta.prompt_token_ids),
                                                          msg.engine_kv, first, meta.sampling, resume=log.tokens[1:]))
            tokens = started
        else:
            with timed_transfer():
                kv = await ctx.transfer.get(msg.owner, msg.kv)  # OwnerGoneError: the runner restarts
            tokens = self._engine.decode(meta.request_id, kv, msg.rope_delta, msg.prompt_len, first, meta.sampling,
                                         resume=log.tokens[1:], prompt_ids=meta.prompt_token_ids)
            del kv
        await stream_completion(ctx.events, meta, tokens, tokenizer=self._engine.tokenizer,
                                eos_token_ids=self._engine.eos_token_ids, prompt_len=msg.prompt_len,
                                first_token=first, skip_deltas=log.deltas, cached_tokens=msg.cached_tokens,
                                aborted=abort_check(ctx, meta),
                                lookahead_tokens=0 if self._engine.capabilities.decodes_ahead else LOOKAHEAD_TOKENS)
        if started is not None and not started.began:
            # the completion ended before a token was asked for (eos first, max_tokens 1): read
            # the KV anyway (one discarded token), so the producer frees it now, not at its lease
            one = msgspec.structs.replace(meta.sampling, max_tokens=1)
            async for _ in self._engine.decode_remote(meta.request_id, list(meta.prompt_token_ids), msg.engine_kv,
                                                      first, one):
                pass
        return done


class _Started:
    """An async iterator that remembers whether anyone asked it for a value."""

    def __init__(self, tokens) -> None:
        self._tokens = tokens
        self.began = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> int:
        self.began = True
        return await self._tokens.__anext__()

    async def aclose(self) -> None:
        await self._tokens.aclose()


_KV_READ = "decode-kv-read"  # ledger stage name: this attempt's engine KV was (being) read


async def _read_once(ctx: Context, meta: protocol.RequestMeta) -> None:
    """Mark this attempt's engine KV as read, or raise OwnerGoneError if an earlier decode of
    the attempt already did (its blocks are freed at the producer, maybe reused)."""
    if ctx.ledger is None:
        return
    if await ctx.ledger.is_done(meta.request_id, _KV_READ, meta.attempt):
        raise OwnerGoneError(f"the prompt's KV for attempt {meta.attempt} was already read by an earlier decode")
    await ctx.ledger.mark_done(meta.request_id, _KV_READ, meta.attempt)
