"""prefill and decode in one worker: the engine prefills and decodes in one place (no KV leaves
the engine) and the tokens are written to the request's Redis stream as they come.

In: ``PrefillRequest``. Out: the token stream; releases encode's embedding slots at the end.
Like decode it first reads the request's token log: a finished request is not generated again,
a partly streamed one resumes after its last logged token (``shared.engines.token_stream``).

Design: docs/design/decode-core.md.
"""

from __future__ import annotations

from services.prefill.handler import embedding_releases, fit_context, pull_media
from shared import protocol
from shared.embcache.pull import EmbeddingPuller
from shared.engines.base import Engine
from shared.engines.token_stream import abort_check, read_log, stream_completion
from shared.stage import Context, Outcome


class GenerateHandler:
    def __init__(self, engine: Engine, puller: EmbeddingPuller | None = None) -> None:
        self._engine = engine
        self._puller = puller

    async def handle(self, msg: protocol.PrefillRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        prompt_len, msg = fit_context(msg, self._engine.max_model_len)
        meta = msg.meta
        log = await read_log(ctx.events, meta.request_id)
        if log.done:
            return Outcome(releases=embedding_releases(msg))
        media = await pull_media(msg, ctx, self._puller)
        salt = {"cache_salt": meta.cache_scope} if self._engine.capabilities.cache_salt and meta.cache_scope else {}
        tokens = self._engine.generate(meta.request_id, list(meta.prompt_token_ids), media, meta.sampling,
                                       resume=log.tokens, **salt)
        await stream_completion(ctx.events, meta, tokens, tokenizer=self._engine.tokenizer,
                                eos_token_ids=self._engine.eos_token_ids, prompt_len=prompt_len,
                                skip_deltas=log.deltas, aborted=abort_check(ctx, meta))
        return Outcome(releases=embedding_releases(msg))
