"""A prefill worker's use of its prefix cache for one request (:class:`PrefixReuse`): find the
longest cached prefix before the forward, keep the new blocks after it, count both, and return
what the cache changed for the routing table. The reused prefix is cut to ``prompt_len - 1``
positions when it covers the whole prompt (the last position's logits give the first token).
Engines with a prefix cache of their own (``capabilities.kv_events``: vLLM) use
:class:`EngineCacheReport` instead, with the same hashes (exactly the router's).

Design: docs/design/kv-routing.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from prometheus_client import Counter, Gauge

from shared import protocol
from shared.kv.blocks import block_hashes
from shared.kv.prefix_cache import CacheChanges, PrefixCache

BLOCKS_HIT = Counter("mmfleet_prefix_blocks_hit_total", "Prompt KV blocks reused from the prefix cache", ["worker"])
BLOCKS_COMPUTED = Counter("mmfleet_prefix_blocks_computed_total",
                          "Whole prompt KV blocks computed (not found in the prefix cache)", ["worker"])
CACHE_BYTES = Gauge("mmfleet_prefix_cache_bytes", "Bytes of KV held by the prefill worker's prefix cache", ["worker"])


@dataclass(frozen=True)
class Lookup:
    hashes: list[int]
    prefix_kv: torch.Tensor | None  # packed KV of the reused positions, None when nothing is reused
    prefix_len: int  # reused prompt positions
    hit_blocks: int


class PrefixReuse:
    """``metric_label``: the ``worker`` label of this process's series; stable across restarts
    (a restarted worker continues its series instead of starting new ones)."""

    def __init__(self, cache: PrefixCache, placeholder_id: "int | frozenset[int]", *,
                 metric_label: str = "prefill") -> None:
        self.cache = cache
        self._placeholder = placeholder_id
        self._label = metric_label

    def lookup(self, msg: protocol.PrefillRequest, prompt_len: int) -> Lookup:
        """``prompt_len``: the expanded prompt's length (positions)."""
        hashes = block_hashes(msg.meta.prompt_token_ids, msg.items, placeholder_id=self._placeholder,
                              block_size=self.cache.block_size, salt=msg.meta.cache_scope)
        blocks = self.cache.match(hashes)
        prefix_len = min(len(blocks) * self.cache.block_size, prompt_len - 1)
        if prefix_len <= 0:
            return Lookup(hashes, None, 0, 0)
        kv = torch.cat(blocks, dim=3) if len(blocks) > 1 else blocks[0]
        return Lookup(hashes, kv[:, :, :, :prefix_len, :].contiguous(), prefix_len, len(blocks))

    def keep(self, lookup: Lookup, kv: torch.Tensor) -> CacheChanges:
        """Store the prompt's blocks from its full packed ``kv``; what the cache changed."""
        BLOCKS_HIT.labels(self._label).inc(lookup.hit_blocks)
        BLOCKS_COMPUTED.labels(self._label).inc(len(lookup.hashes) - lookup.hit_blocks)
        changes = self.cache.store(lookup.hashes, kv)
        CACHE_BYTES.labels(self._label).set(self.cache.bytes)
        return changes


class EngineCacheReport:
    """For an engine with its own prefix cache: the prompt's block hashes to give it (the
    router's, from the same message) and what its reported changes publish. Counts blocks hit /
    computed like :class:`PrefixReuse` (hits from the engine's ``cached_tokens``)."""

    def __init__(self, placeholder_id: "int | frozenset[int]", block_size: int, *,
                 metric_label: str = "prefill") -> None:
        self.block_size = block_size
        self._placeholder = placeholder_id
        self._label = metric_label

    def hashes(self, msg: protocol.PrefillRequest) -> list[int]:
        return block_hashes(msg.meta.prompt_token_ids, msg.items, placeholder_id=self._placeholder,
                            block_size=self.block_size, salt=msg.meta.cache_scope)

    def hit_blocks(self, cached_tokens: int) -> int:
        return cached_tokens // self.block_size

    def report(self, hashes: list[int], cached_tokens: int, changes: CacheChanges | None) -> CacheChanges:
        """Count the request's blocks; the engine's cache changes (none: nothing changed)."""
        hit = min(self.hit_blocks(cached_tokens), len(hashes))
        BLOCKS_HIT.labels(self._label).inc(hit)
        BLOCKS_COMPUTED.labels(self._label).inc(len(hashes) - hit)
        return changes or CacheChanges()
