"""prefill: pull the request's embeddings over NIXL, run the language model over the prompt,
sample the first token, keep the KV cache in this worker's pool and send its descriptor on.

In: ``PrefillRequest`` (text-only ones come straight from the gateway). Out: ``DecodeRequest`` on
``mm.decode``; encode's slots are released once produced. The first token (and while its text is
held back, a few more) goes into the stream here (``write_first_delta``). Needs ``kv_export``:
KV packed into the pool, or left in the engine (``remote_kv``, vLLM: ``engine_kv``). With
``prefix_kv`` the longest cached prefix is reused and the cache's changes go to the routing
table (``TableWriter``); an engine with its own cache reports them. Design: docs/design/kv-routing.md.
"""

from __future__ import annotations

import functools

import msgspec

from shared import metrics, protocol
from shared.embcache.pull import EmbeddingPuller
from shared.engines.base import Engine, MediaEmbeds, PrefillOutput
from shared.engines.token_stream import write_first_delta
from shared.keys import TOPIC_DECODE
from shared.kv.audit import RouteAudit
from shared.kv.prefix_cache import CacheChanges
from shared.kv.reuse import EngineCacheReport, Lookup, PrefixReuse
from shared.kv.table import LoadTracker, TableWriter
from shared.stage import Context, Outcome, Produce, RequestFailed
from shared.tracing import timed_transfer


def expanded_prompt_len(msg: protocol.PrefillRequest) -> int:
    """Prompt length once each media placeholder becomes the item's tokens."""
    return len(msg.meta.prompt_token_ids) + sum(it.n_tokens - 1 for it in msg.items)


def fit_context(msg: protocol.PrefillRequest, max_model_len: int) -> tuple[int, protocol.PrefillRequest]:
    """(the prompt's length with its media tokens, ``msg`` with max_tokens lowered to the context
    that prompt leaves, as vllm serve does); a prompt that leaves none is a 400."""
    total = expanded_prompt_len(msg)
    if total >= max_model_len:
        raise RequestFailed.bad_request(
            f"prompt ({total} tokens with media) leaves no room in the model's context of {max_model_len} tokens",
            param="messages", code="context_length_exceeded")
    sampling = msg.meta.sampling
    if total + sampling.max_tokens > max_model_len:
        sampling = msgspec.structs.replace(sampling, max_tokens=max_model_len - total,
                                           min_tokens=min(sampling.min_tokens, max_model_len - total))
        msg = msgspec.structs.replace(msg, meta=msgspec.structs.replace(msg.meta, sampling=sampling))
    return total, msg


async def pull_media(msg: protocol.PrefillRequest, ctx: Context,
                      puller: EmbeddingPuller | None = None) -> list[MediaEmbeds]:
    """The request's embeddings in prompt order, pulled from their owners (through the
    embedding cache's checks and prefill's recent copies when ``puller`` has them)."""
    media = await (puller or _PLAIN).pull(msg, ctx)
    for it in msg.items:
        metrics.MEDIA_TOKENS.labels(metrics.modality_of(it.kind)).inc(it.n_tokens)
    return media


def embedding_releases(msg: protocol.PrefillRequest) -> list[tuple[protocol.AgentRef, list[int]]]:
    """Leases to release once the output is durable (cache hits found through the index hold
    no lease: ``lease == 0``)."""
    owners = {o.name: o for o in msg.owners}
    by_owner: dict[str, list[int]] = {}
    for it in msg.items:
        if it.embeds.lease:
            by_owner.setdefault(it.embeds.agent, []).append(it.embeds.lease)
    return [(owners[name], leases) for name, leases in by_owner.items()]


_PLAIN = EmbeddingPuller()


class PrefillHandler:
    def __init__(self, engine: Engine, prefix: PrefixReuse | None = None, load: LoadTracker | None = None,
                 puller: EmbeddingPuller | None = None, audit: RouteAudit | None = None,
                 engine_cache: EngineCacheReport | None = None, table: TableWriter | None = None) -> None:
        self._engine = engine
        self._prefix = prefix if engine.capabilities.prefix_kv else None
        self._engine_cache = engine_cache if engine.capabilities.kv_events else None
        self._audit = audit if self._prefix is not None or self._engine_cache is not None else None
        self._table = table
        self._load = load or LoadTracker()
        self._puller = puller

    async def handle(self, msg: protocol.PrefillRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        total, msg = fit_context(msg, self._engine.max_model_len)
        meta = msg.meta
        media = await pull_media(msg, ctx, self._puller)
        if self._engine_cache is not None:
            return await self._handle_engine_cache(msg, ctx, total, media)
        lookup = self._prefix.lookup(msg, total) if self._prefix is not None else Lookup([], None, 0, 0)
        with self._load.track(total - lookup.prefix_len):
            if lookup.prefix_kv is None:  # engines without prefix_kv take no such argument
                out = await self._engine.prefill(meta.request_id, list(meta.prompt_token_ids), media, meta.sampling)
            else:
                out = await self._engine.prefill(meta.request_id, list(meta.prompt_token_ids), media, meta.sampling,
                                                 prefix_kv=lookup.prefix_kv)
        await self._first_delta(ctx, meta, out)  # the client's first token before the cache bookkeeping
        # why this request did (not) reuse KV, beside the request: written after the first token, as
        # its Python on this loop would otherwise compete with the forward's thread for the GIL
        if self._audit is not None:
            self._audit.prefilled(msg, ctx.worker_id, lookup.hit_blocks)
        if self._prefix is not None:
            self._cache_changed(self._prefix.keep(lookup, out.kv))
        return await self._outcome(msg, ctx, out, lookup.prefix_len)

    async def _handle_engine_cache(self, msg: protocol.PrefillRequest, ctx: Context, total: int,
                                   media: list[MediaEmbeds]) -> Outcome:
        """The engine's own prefix cache: it gets the block hashes, reports hits and changes."""
        meta, report = msg.meta, self._engine_cache
        hashes = report.hashes(msg)
        with self._load.track(total):  # the hit is known only once the engine has scheduled it
            salt = {"cache_salt": meta.cache_scope} if self._engine.capabilities.cache_salt and meta.cache_scope else {}
            out = await self._engine.prefill(meta.request_id, list(meta.prompt_token_ids), media, meta.sampling,
                                             block_keys=hashes, **salt)
        await self._first_delta(ctx, meta, out)
        if self._audit is not None:
            self._audit.prefilled(msg, ctx.worker_id, report.hit_blocks(out.cached_tokens))
        self._cache_changed(report.report(hashes, out.cached_tokens, out.kv_changes))
        return await self._outcome(msg, ctx, out, out.cached_tokens)

    def _cache_changed(self, changes: CacheChanges) -> None:
        if self._table is not None:
            self._table.changed(changes)

    async def _first_delta(self, ctx: Context, meta: protocol.RequestMeta, out: PrefillOutput) -> None:
        more = None
        if out.kv is not None:  # a packed KV: a first token without text yet gets its next ones from it (copied)
            more = functools.partial(self._engine.decode, meta.request_id, out.kv, out.rope_delta, out.prompt_len,
                                     out.first_token, meta.sampling, prompt_ids=meta.prompt_token_ids)
        await write_first_delta(ctx.events, meta, out.first_token, tokenizer=self._engine.tokenizer,
                                eos_token_ids=self._engine.eos_token_ids, more=more)

    async def _outcome(self, msg: protocol.PrefillRequest, ctx: Context, out: PrefillOutput,
                       cached_tokens: int) -> Outcome:
        """After the first delta is written: the KV handed to decode."""
        meta = msg.meta
        owner = ctx.transfer.ref()
        if out.engine_kv is not None:  # the KV stays in the engine; decode's engine reads it
            kv_ref = protocol.empty_tensor_ref(owner.name)
        else:
            with timed_transfer():
                kv_ref = await ctx.transfer.put_wait(out.kv, timeout_ms=5_000)
        decode = protocol.DecodeRequest(meta=meta, owner=owner, kv=kv_ref, prompt_len=out.prompt_len,
                                        rope_delta=out.rope_delta, first_token=int(out.first_token),
                                        cached_tokens=cached_tokens, engine_kv=out.engine_kv,
                                        first_logprob=getattr(out.first_token, "logprob", None))
        return Outcome([Produce(TOPIC_DECODE, meta.request_id, decode)], embedding_releases(msg))
