"""Growing KV layers (shared.engines.kv_grow): the same keys / values as transformers' own
concatenating layer after any sequence of updates, appends that copy only the new positions
while there is room, and views handed in from outside (the batched decoder's write-back)
adopted, not written through."""

from __future__ import annotations

import torch
from transformers import Qwen2Config
from transformers.cache_utils import DynamicCache, DynamicLayer

from shared.engines.kv_grow import MIN_ROOM, GrowingLayer, growing_cache


def _kv(b: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, n, 8, generator=g), torch.randn(b, 2, n, 8, generator=g)


def test_updates_equal_concatenation_and_append_in_place():
    grow, plain = GrowingLayer(), DynamicLayer()
    steps = [37, 1, 1, 5] + [1] * 200  # a prompt, then decode steps past several reallocations
    moves = 0
    for i, n in enumerate(steps):
        k, v = _kv(2, n, i)
        before = grow._kbuf.data_ptr() if grow._kbuf is not None else None
        gk, gv = grow.update(k, v)
        pk, pv = plain.update(k, v)
        assert torch.equal(gk, pk) and torch.equal(gv, pv)
        assert gk.data_ptr() == grow._kbuf.data_ptr()  # the keys ARE the buffer: nothing else was copied
        moves += before is not None and before != grow._kbuf.data_ptr()
    total = sum(steps)
    assert grow.get_seq_length() == total
    assert grow._kbuf.shape[-2] <= total + max(MIN_ROOM, total // 4) + 1  # bounded spare room
    assert 1 <= moves <= 6  # reallocated a few times in 204 appends, not at every one


def test_views_set_from_outside_are_adopted_not_written_through():
    layer = GrowingLayer()
    layer.update(*_kv(1, 10, 0))
    outer_k, outer_v = _kv(3, 20, 1)
    keep_k, keep_v = outer_k.clone(), outer_v.clone()
    layer.keys, layer.values = outer_k[1:2, :, 5:], outer_v[1:2, :, 5:]  # as Stack.write_back does
    assert layer._kbuf is None and layer._vbuf is None  # its own buffers are let go at once
    new_k, new_v = _kv(1, 1, 2)
    k, v = layer.update(new_k, new_v)
    assert torch.equal(k, torch.cat([keep_k[1:2, :, 5:], new_k], dim=2))
    assert torch.equal(v, torch.cat([keep_v[1:2, :, 5:], new_v], dim=2))
    assert torch.equal(outer_k, keep_k) and torch.equal(outer_v, keep_v)  # the batch's tensor untouched


def test_growing_cache_holds_the_layers_given_and_copies_them():
    cfg = Qwen2Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=3,
                      intermediate_size=32, vocab_size=50)
    layers = [_kv(1, 12, i) for i in range(3)]
    cache = growing_cache(cfg, layers)
    assert isinstance(cache, DynamicCache) and all(isinstance(x, GrowingLayer) for x in cache.layers)
    assert cache.get_seq_length() == 12
    for layer, (k, v) in zip(cache.layers, layers, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        assert layer.keys.data_ptr() != k.data_ptr()  # a copy: the caller keeps its buffer
