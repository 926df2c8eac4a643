"""Prefill's recent embeddings: a byte-bounded LRU of tensors it pulled, by cache key.

A cache key names content (media bytes + model + processor), so a copy held here is right
whatever happened to the owner's slot since: a follow-up turn that shows the same image again
is served from here without a pull or an index check. Items larger than the whole capacity
are not kept. Single event loop; not thread-safe.
"""

from __future__ import annotations

import collections

import torch

from shared.embcache.metrics import POOL_BYTES


class RecentEmbeddings:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self.bytes = 0

    def get(self, key: str) -> torch.Tensor | None:
        t = self._items.get(key)
        if t is not None:
            self._items.move_to_end(key)
        return t

    def put(self, key: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if not key or n > self.capacity_bytes or key in self._items:
            return
        while self.bytes + n > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self._items[key] = tensor
        self.bytes += n
        POOL_BYTES.labels(cache="prefill").set(self.bytes)
