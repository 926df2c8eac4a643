"""decode: pull the KV cache over NIXL, generate, and write token deltas to the request's
Redis stream as they come.

In: ``DecodeRequest``. Out: stream events (``TokenDelta``... then ``Finish``); releases
prefill's KV slot at the end. Stops on an eos token, a stop string (the stop string itself is
not sent) or ``max_tokens``. Sampling is seeded per step (``sample_at``), so a seeded request
gives the same tokens whichever workers sample its steps.
"""

from __future__ import annotations

from shared import protocol
from shared.compute import ComputeLane
from shared.engines.detok import IncrementalDetokenizer, StopChecker
from shared.engines.sampling import sample_at
from shared.stage import Context, Outcome


class DecodeHandler:
    def __init__(self, compute, lane: ComputeLane) -> None:
        self._compute = compute  # start_decode / decode_step / tokenizer / eos_token_ids
        self._lane = lane
        self._eos = frozenset(compute.eos_token_ids)

    async def handle(self, msg: protocol.DecodeRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        meta = msg.meta
        sampling = meta.sampling
        kv = await ctx.transfer.get(msg.owner, msg.kv)
        state = await self._lane.run(self._compute.start_decode, kv, msg.rope_delta, msg.prompt_len)
        del kv
        detok = IncrementalDetokenizer(self._compute.tokenizer)
        stops = StopChecker(sampling.stop)
        token, generated, reason = msg.first_token, 0, "length"
        while True:
            generated += 1
            if token in self._eos:
                reason = "stop"
                break
            res = stops.feed(detok.push(token))
            # one delta per token, even with no printable text yet: the log records every
            # token id, which is what a resumed decode continues from
            await ctx.events.append(meta.request_id, protocol.TokenDelta(seq=generated - 1, token_ids=(token,),
                                                                         text=res.emit))
            if res.stopped:
                reason = "stop"
                break
            if generated >= sampling.max_tokens:
                break
            logits = await self._lane.run(self._compute.decode_step, state, token)
            token = sample_at(logits, sampling, step=generated)
        if not stops.stopped:
            # text held back (an incomplete character, a possible stop-string prefix) is final now
            res = stops.feed(detok.flush())
            tail = res.emit + ("" if res.stopped else stops.flush())
            reason = "stop" if res.stopped else reason
            if tail:
                await ctx.events.append(meta.request_id, protocol.TokenDelta(seq=generated, token_ids=(), text=tail))
        usage = protocol.Usage(prompt_tokens=msg.prompt_len, completion_tokens=generated)
        await ctx.events.append(meta.request_id, protocol.Finish(reason=reason, usage=usage))
        return Outcome(releases=[(msg.owner, [msg.kv.lease])])
