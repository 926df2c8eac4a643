"""KV cache layers that grow in place, for the caches decode appends to one position a step.

transformers' ``DynamicLayer.update`` appends with ``torch.cat``, copying the whole context's
keys and values per layer every step (~9 % of a decode worker's samples at 2-3k-token contexts).
:class:`GrowingLayer` writes new positions into spare room of its buffers and returns views:
O(1) copies per step amortised, at most ~25 % + ``MIN_ROOM`` positions unused per layer.
:func:`growing_cache` builds a ``DynamicCache`` of such layers from per-layer ``(keys, values)``.

Design: docs/design/decode-core.md.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

MIN_ROOM = 64  # positions


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` are views of buffers with spare room;
    ``update`` writes the new positions into the room and returns the views, so a step copies only
    its own positions. When the room is used up the buffers are reallocated with a quarter of the
    length (at least ``MIN_ROOM`` positions) spare. ``keys`` / ``values`` set from outside (the
    batched decoder hands each sequence views into its batch) are adopted at the next ``update``
    (one copy)."""

    # keys / values are properties: one assigned from outside (a batch's view, a crop) drops
    # the buffers, so a stale buffer is neither written into nor kept alive
    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        self._keys, self._kbuf = t, None

    @property
    def values(self) -> torch.Tensor | None:
        return self._values

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        self._values, self._vbuf = t, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        empty = self._keys is None or self._keys.dim() != 4 or self._keys.numel() == 0
        keys = key_states[:, :, :0] if empty else self._keys
        values = value_states[:, :, :0] if empty else self._values
        n, need = keys.shape[-2], keys.shape[-2] + key_states.shape[-2]
        kb, vb = self._kbuf, self._vbuf
        if kb is None or vb is None or need > kb.shape[-2]:  # no room (or views from outside): reallocate
            cap = need + max(MIN_ROOM, need // 4)
            kb = keys.new_empty((*keys.shape[:2], cap, keys.shape[-1]))
            vb = values.new_empty((*values.shape[:2], cap, values.shape[-1]))
            kb[:, :, :n].copy_(keys)
            vb[:, :, :n].copy_(values)
        kb[:, :, n:need].copy_(key_states)
        vb[:, :, n:need].copy_(value_states)
        self._keys, self._values, self._kbuf, self._vbuf = kb[:, :, :need], vb[:, :, :need], kb, vb
        return self._keys, self._values


def growing_cache(config, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` (layer types from it) holding ``layers``; its plain
    ``DynamicLayer`` layers grow in place (others, e.g. sliding-window ones, are kept)."""
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(layers):
        if type(cache.layers[i]) is DynamicLayer:
            cache.layers[i] = GrowingLayer()
        cache.layers[i].update(k, v)
    return cache
