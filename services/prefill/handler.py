"""prefill: pull the request's embeddings over NIXL, run the language model over the prompt,
sample the first token, keep the KV cache in this worker's pool and send its descriptor on.

In: ``PrefillRequest`` (text-only requests come straight from the gateway with no items).
Out: ``DecodeRequest`` on ``mm.decode``; releases encode's embedding slots once produced.
"""

from __future__ import annotations

import asyncio

from shared import protocol
from shared.compute import ComputeLane
from shared.engines.sampling import sample_at
from shared.keys import TOPIC_DECODE
from shared.stage import Context, Outcome, Produce, RequestFailed


class PrefillHandler:
    def __init__(self, compute, lane: ComputeLane, *, max_model_len: int) -> None:
        self._compute = compute  # Qwen2VLCompute-like: prefill(prompt_ids, images) -> PrefillResult
        self._lane = lane
        self._max_model_len = max_model_len

    async def handle(self, msg: protocol.PrefillRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        meta = msg.meta
        owners = {o.name: o for o in msg.owners}
        items = sorted(msg.items, key=lambda it: it.index)
        total = len(meta.prompt_token_ids) + sum(it.n_tokens - 1 for it in items)
        if total + meta.sampling.max_tokens > self._max_model_len:
            raise RequestFailed.bad_request(
                f"prompt ({total} tokens with media) plus max_tokens ({meta.sampling.max_tokens}) exceeds the "
                f"model's context of {self._max_model_len} tokens", param="max_tokens",
                code="context_length_exceeded")
        embeds = await asyncio.gather(*(ctx.transfer.get(owners[it.embeds.agent], it.embeds) for it in items))
        images = [(emb, it.grid_thw) for emb, it in zip(embeds, items, strict=True)]
        result = await self._lane.run(self._compute.prefill, list(meta.prompt_token_ids), images)
        first = sample_at(result.last_logits, meta.sampling, step=0)
        kv_ref = await ctx.transfer.put_wait(result.kv, timeout_ms=5_000)
        out = protocol.DecodeRequest(meta=meta, owner=ctx.transfer.ref(), kv=kv_ref, prompt_len=result.prompt_len,
                                     rope_delta=result.rope_delta, first_token=first)
        by_owner: dict[str, list[int]] = {}
        for it in items:
            by_owner.setdefault(it.embeds.agent, []).append(it.embeds.lease)
        return Outcome([Produce(TOPIC_DECODE, meta.request_id, out)],
                       [(owners[name], leases) for name, leases in by_owner.items()])
