"""decode: generate and write token deltas to the request's Redis stream as they come.

Two handlers, chosen by the worker's stage layout:
- ``DecodeHandler`` (decode apart from prefill): In ``DecodeRequest``; pulls the KV cache over
  NIXL and continues after the first token; releases prefill's KV slot at the end.
- ``GenerateHandler`` (prefill and decode in one worker): In ``PrefillRequest``; the engine
  prefills and decodes in one place (no KV leaves the engine); releases encode's slots.
"""

from __future__ import annotations

from services.decode.stream import stream_completion
from services.prefill.handler import check_context, embedding_releases, pull_images
from shared import protocol
from shared.engines.base import Engine
from shared.stage import Context, Outcome
from shared.tracing import timed_transfer


class DecodeHandler:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def handle(self, msg: protocol.DecodeRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        meta = msg.meta
        with timed_transfer():
            kv = await ctx.transfer.get(msg.owner, msg.kv)
        tokens = self._engine.decode(meta.request_id, kv, msg.rope_delta, msg.prompt_len, msg.first_token,
                                     meta.sampling)
        del kv
        await stream_completion(ctx.events, meta, tokens, tokenizer=self._engine.tokenizer,
                                eos_token_ids=self._engine.eos_token_ids, prompt_len=msg.prompt_len,
                                first_token=msg.first_token)
        return Outcome(releases=[(msg.owner, [msg.kv.lease])])


class GenerateHandler:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def handle(self, msg: protocol.PrefillRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        meta = msg.meta
        prompt_len = check_context(msg, self._engine.max_model_len)
        images = await pull_images(msg, ctx)
        tokens = self._engine.generate(meta.request_id, list(meta.prompt_token_ids), images, meta.sampling)
        await stream_completion(ctx.events, meta, tokens, tokenizer=self._engine.tokenizer,
                                eos_token_ids=self._engine.eos_token_ids, prompt_len=prompt_len)
        return Outcome(releases=embedding_releases(msg))
