"""The prefill worker's prefix KV cache (:class:`PrefixCache`): recent prompts' KV by block hash
(:mod:`shared.kv.blocks`), LRU, bounded in bytes (``capacity_bytes``). A prompt's blocks are
looked up in order and reuse stops at the first miss; a value is one block's KV, a clone (a cached
block never pins a whole prompt's tensor). A lookup refreshes its hits from the last to the
first, so a prefix's root is evicted after its descendants. Every change is reported to the
caller (``stored`` / ``removed``) to publish as KV events; no I/O, one event loop.

Design: docs/design/kv-routing.md.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class CacheChanges:
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False  # everything held before was dropped (applied before ``stored``)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


class PrefixCache:
    def __init__(self, capacity_bytes: int, block_size: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def match(self, hashes: list[int]) -> list[torch.Tensor]:
        """The cached KV blocks of the longest cached prefix of ``hashes`` (maybe none)."""
        hit: list[torch.Tensor] = []
        for h in hashes:
            kv = self._blocks.get(h)
            if kv is None:
                break
            hit.append(kv)
        for h in reversed(hashes[: len(hit)]):
            self._blocks.move_to_end(h)
        return hit

    def store(self, hashes: list[int], kv: torch.Tensor) -> CacheChanges:
        """Keep the blocks of a prompt's packed KV ``[layers, 2, kv_heads, seq, head_dim]``
        whose hashes are not cached yet; ``hashes`` covers the whole blocks of ``seq``."""
        changes = CacheChanges()
        if self.capacity_bytes <= 0:
            return changes
        bs = self.block_size
        if kv.shape[3] < len(hashes) * bs:
            raise ValueError(f"KV of {kv.shape[3]} positions cannot hold {len(hashes)} blocks of {bs}")
        for i, h in enumerate(hashes):
            if h in self._blocks:
                continue
            block = kv[:, :, :, i * bs:(i + 1) * bs, :].clone()
            nbytes = block.numel() * block.element_size()
            if nbytes > self.capacity_bytes:
                break
            self._blocks[h] = block
            self.bytes += nbytes
            changes.stored.append(h)
        for h in reversed(hashes):  # the prompt just seen is the most recent; its root most of all
            if h in self._blocks:
                self._blocks.move_to_end(h)
        while self.bytes > self.capacity_bytes and self._blocks:
            h, old = self._blocks.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
            changes.removed.append(h)
        # a block stored and evicted in the same call was never visible to anyone
        gone = set(changes.stored) & set(changes.removed)
        if gone:
            changes.stored = [h for h in changes.stored if h not in gone]
            changes.removed = [h for h in changes.removed if h not in gone]
        return changes

    def clear(self) -> list[int]:
        removed = list(self._blocks)
        self._blocks.clear()
        self.bytes = 0
        return removed
