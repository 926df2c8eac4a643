"""KV cache layers that grow in place, for the caches decode appends to one position a step.

transformers' ``DynamicLayer.update`` appends with ``torch.cat``: every decode step copies the
whole context's keys and values, per layer (at 2-3k-token contexts that copy was ~9 % of a
decode worker's samples, README "KV routing"). Contract:
- :class:`GrowingLayer` is a ``DynamicLayer`` whose ``keys`` / ``values`` are views of buffers
  with spare room; ``update`` writes the new positions into the room and returns the views, so
  a step copies only its own positions. When the room is used up the buffers are reallocated
  with a quarter of the length (at least ``MIN_ROOM`` positions) spare: O(1) copies per step
  amortised, at most ~25 % + ``MIN_ROOM`` positions of memory unused per layer.
- ``keys`` / ``values`` set from outside (the batched decoder hands each sequence views into its
  batch, :mod:`shared.engines.batched`) are adopted at the next ``update`` (one copy).
- :func:`growing_cache` builds a ``DynamicCache`` of such layers from per-layer
  ``(keys, values)`` ``[batch, kv_heads, seq, head_dim]``, copied once into their buffers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

MIN_ROOM = 64  # positions


class GrowingLayer(DynamicLayer):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def _owned(self) -> bool:
        """True when ``keys`` / ``values`` are still the views this layer handed out."""
        kb = self._kbuf
        return (kb is not None and self.keys is not None and self.keys.data_ptr() == kb.data_ptr()
                and self.keys.shape[:2] == kb.shape[:2] and self.keys.shape[-1] == kb.shape[-1]
                and self.values.data_ptr() == self._vbuf.data_ptr() and self.keys.stride() == kb.stride())

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, need: int) -> None:
        """New buffers for ``need`` positions plus room, holding ``keys`` / ``values``."""
        n = keys.shape[-2]
        cap = need + max(MIN_ROOM, need // 4)
        b, h, _, d = keys.shape
        self._kbuf = keys.new_empty((b, h, cap, d))
        self._vbuf = values.new_empty((b, values.shape[1], cap, values.shape[-1]))
        self._kbuf[:, :, :n].copy_(keys)
        self._vbuf[:, :, :n].copy_(values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        empty = self.keys is None or self.keys.dim() != 4 or self.keys.numel() == 0
        keys = key_states[:, :, :0] if empty else self.keys
        values = value_states[:, :, :0] if empty else self.values
        n, add = keys.shape[-2], key_states.shape[-2]
        if not (self._owned() and not empty) or n + add > self._kbuf.shape[-2]:
            self._reserve(keys, values, n + add)
        self._kbuf[:, :, n:n + add].copy_(key_states)
        self._vbuf[:, :, n:n + add].copy_(value_states)
        self.keys, self.values = self._kbuf[:, :, :n + add], self._vbuf[:, :, :n + add]
        return self.keys, self.values


def growing_cache(config, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` (layer types from it) holding ``layers``; its plain
    ``DynamicLayer`` layers grow in place (others, e.g. sliding-window ones, are kept)."""
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(layers):
        if type(cache.layers[i]) is DynamicLayer:
            cache.layers[i] = GrowingLayer()
        cache.layers[i].update(k, v)
    return cache
