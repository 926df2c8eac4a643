"""Prefill's recent embeddings: a byte-bounded LRU (``cachetools.LRUCache`` sized in bytes) of
tensors it pulled, by cache key. A cache key names content (media bytes + model + processor), so
a copy held here is right whatever happened to the owner's slot since: a follow-up turn that
shows the same image again is served without a pull or an index check. Items larger than the
whole capacity are not kept. Single event loop; not thread-safe.

Design: docs/design/embedding-cache.md.
"""

from __future__ import annotations

import torch
from cachetools import LRUCache

from shared.embcache.metrics import POOL_BYTES


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RecentEmbeddings:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: LRUCache[str, torch.Tensor] = LRUCache(maxsize=capacity_bytes, getsizeof=_nbytes)

    @property
    def bytes(self) -> int:
        return int(self._items.currsize)

    def get(self, key: str) -> torch.Tensor | None:
        return self._items.get(key)

    def put(self, key: str, tensor: torch.Tensor) -> None:
        if not key or _nbytes(tensor) > self.capacity_bytes or key in self._items:
            return
        self._items[key] = tensor
        POOL_BYTES.labels(cache="prefill").set(self.bytes)
