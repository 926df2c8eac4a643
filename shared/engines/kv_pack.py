"""The packed KV layout the transformers compute paths exchange, written once.

Packed: one contiguous tensor ``[layers, 2 (key, value), kv_heads, seq, head_dim]`` of a batch-1
``DynamicCache``, in the cache's device and dtype (float32 on CPU, the model dtype on a GPU):
what prefill exports over NIXL, the prefix cache stores by block and decode imports.
:func:`unpack_kv` copies, so the caller keeps its buffer.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import torch


def pack_kv(cache, row: int = 0, length: int | None = None) -> torch.Tensor:
    """A ``DynamicCache``'s batch row ``row`` (its first ``length`` positions; all by default) →
    the packed tensor (a copy)."""
    per_layer = [torch.stack([layer.keys[row, :, :length], layer.values[row, :, :length]]) for layer in cache.layers]
    return torch.stack(per_layer).contiguous()


def unpack_kv(kv_packed: torch.Tensor, expected: tuple[int, int, int, int, int], config, *,
              device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The packed tensor → a ``DynamicCache`` for ``config`` (its text config) on the model's
    ``device`` / ``dtype``; ``expected``: the shape it must have, ``(layers, 2, kv_heads, seq,
    head_dim)`` (ValueError otherwise)."""
    from shared.engines.kv_grow import growing_cache

    if tuple(kv_packed.shape) != expected:
        raise ValueError(f"packed KV shape {tuple(kv_packed.shape)} != {expected}")
    kv = kv_packed.to(device, dtype)
    # decode appends to this cache a position a step: its layers grow in place (one copy here)
    return growing_cache(config, [(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(expected[0])])
