"""prefill: pull the request's embeddings over NIXL, run the language model over the prompt,
sample the first token, keep the KV cache in this worker's pool and send its descriptor on.

In: ``PrefillRequest`` (text-only requests come straight from the gateway with no items).
Out: ``DecodeRequest`` on ``mm.decode``; releases encode's embedding slots once produced.
Needs an engine that exports KV (``capabilities.kv_export``).
"""

from __future__ import annotations

import asyncio

from shared import protocol
from shared.engines.base import Engine, MediaEmbeds
from shared.keys import TOPIC_DECODE
from shared.stage import Context, Outcome, Produce, RequestFailed
from shared.tracing import timed_transfer


def expanded_prompt_len(msg: protocol.PrefillRequest) -> int:
    """Prompt length once each media placeholder becomes the item's tokens."""
    return len(msg.meta.prompt_token_ids) + sum(it.n_tokens - 1 for it in msg.items)


def check_context(msg: protocol.PrefillRequest, max_model_len: int) -> int:
    total = expanded_prompt_len(msg)
    if total + msg.meta.sampling.max_tokens > max_model_len:
        raise RequestFailed.bad_request(
            f"prompt ({total} tokens with media) plus max_tokens ({msg.meta.sampling.max_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
    return total


async def pull_images(msg: protocol.PrefillRequest, ctx: Context) -> list[MediaEmbeds]:
    """The request's embeddings in prompt order, pulled from their owners."""
    owners = {o.name: o for o in msg.owners}
    items = sorted(msg.items, key=lambda it: it.index)
    with timed_transfer():
        embeds = await asyncio.gather(*(ctx.transfer.get(owners[it.embeds.agent], it.embeds) for it in items))
    return [MediaEmbeds(emb, it.grid_thw, it.kind) for emb, it in zip(embeds, items, strict=True)]


def embedding_releases(msg: protocol.PrefillRequest) -> list[tuple[protocol.AgentRef, list[int]]]:
    owners = {o.name: o for o in msg.owners}
    by_owner: dict[str, list[int]] = {}
    for it in msg.items:
        by_owner.setdefault(it.embeds.agent, []).append(it.embeds.lease)
    return [(owners[name], leases) for name, leases in by_owner.items()]


class PrefillHandler:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def handle(self, msg: protocol.PrefillRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        meta = msg.meta
        check_context(msg, self._engine.max_model_len)
        images = await pull_images(msg, ctx)
        out = await self._engine.prefill(meta.request_id, list(meta.prompt_token_ids), images, meta.sampling)
        with timed_transfer():
            kv_ref = await ctx.transfer.put_wait(out.kv, timeout_ms=5_000)
        decode = protocol.DecodeRequest(meta=meta, owner=ctx.transfer.ref(), kv=kv_ref, prompt_len=out.prompt_len,
                                        rope_delta=out.rope_delta, first_token=out.first_token)
        return Outcome([Produce(TOPIC_DECODE, meta.request_id, decode)], embedding_releases(msg))
