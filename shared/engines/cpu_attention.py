"""The transformers engine's LM attention on CPU: two paths where transformers' SDPA call wastes
work, everything else handed to it unchanged. A prefill that continues a cached prefix runs the
cached part (unmasked) and the new part (causal) apart through torch's CPU flash kernel, merged by
their log-sum-exp, and builds no mask (from ``SPLIT_MIN_PAIRS`` up). A masked call with grouped
KV heads (a batched decode step's padding) reads the shared heads in place (``enable_gqa``)
where transformers copies K / V per query head (``repeat_kv``). Both equal transformers' results
(``tests/unit/test_cpu_attention.py``); :func:`install` points the LM's attention here on CPU.

Design: docs/design/overhead.md.
"""

from __future__ import annotations

import logging

import torch

F = torch.nn.functional
log = logging.getLogger(__name__)

NAME = "mmfleet_cpu_sdpa"
# private but stable since torch 2.3: (output, logsumexp, ...); the public SDPA hides the LSE
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# new positions x all positions below which one masked call beats two calls and a merge (measured:
# the split wins from ~256 new over 512; 91 over 123, a short chat's template hit, lost 0.3 ms a prefill)
SPLIT_MIN_PAIRS = 1 << 17


def _is_prefix_causal(q_length: int, kv_length: int, q_offset: int, kv_offset: int, mask_function,
                      attention_mask: torch.Tensor | None, local_size: int | None) -> bool:
    """True when the mask would be exactly "all of the cache, then causal", with a cache, and
    large enough for the split to pay."""
    from transformers.masking_utils import causal_mask_function

    return (mask_function is causal_mask_function and local_size is None and kv_offset == 0
            and 1 < q_length < kv_length and q_offset + q_length == kv_length
            and q_length * kv_length >= SPLIT_MIN_PAIRS
            and (attention_mask is None or bool(attention_mask.all())))


def _is_padded_step(q_length: int, kv_length: int, q_offset: int, kv_offset: int, mask_function,
                    attention_mask: torch.Tensor | None, local_size: int | None) -> bool:
    """A batched decode step: one new position per sequence, after a cache, under a padding mask."""
    from transformers.masking_utils import causal_mask_function

    return (q_length == 1 and q_offset == kv_length - 1 and kv_offset == 0 and local_size is None
            and mask_function is causal_mask_function and attention_mask is not None
            and attention_mask.dim() == 2 and attention_mask.dtype == torch.bool
            and attention_mask.shape[1] == kv_length and not bool(attention_mask.all()))


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
          mask_function=None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
          allow_is_causal_skip: bool = True, **kwargs):
    """transformers' SDPA mask, except None for a prefix continuation (see the module contract)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    if allow_is_causal_skip and _is_prefix_causal(q_length, kv_length, q_offset, kv_offset, mask_function,
                                                  attention_mask, local_size):
        return None
    if _is_padded_step(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size):
        # one query at the last position sees every key the padding lets it: the padding mask is
        # the mask (sdpa_mask builds the same from index functions, ~60 us a step)
        return attention_mask[:, None, None, :kv_length]
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     local_size, allow_is_causal_skip, **kwargs)


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Queries [b, h, q, d] over keys / values [b, hk, kv, d] (kv > q, h = g·hk): the first
    kv - q keys unmasked, the last q causally. Returns [b, h, q, d]."""
    b, h, q, d = query.shape
    hk, kv = key.shape[1], key.shape[2]
    g, cached = h // hk, kv - q
    # every new position sees every cached one, so a KV head's query group folds into the query
    # length: no copy of the (long) cached K / V per query head
    o1, lse1 = _FLASH(query.reshape(b, hk, g * q, d), key[:, :, :cached], value[:, :, :cached], scale=scale)[:2]
    o2, lse2 = _FLASH(query, key[:, :, cached:], value[:, :, cached:], is_causal=True, scale=scale)[:2]
    o1, lse1 = o1.reshape(b, h, q, d), lse1.reshape(b, h, q)
    lse = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - lse).unsqueeze(-1) + o2 * torch.exp(lse2 - lse).unsqueeze(-1)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_length, kv_length = query.shape[2], key.shape[2]
    plain = (not dropout and query.device.type == "cpu" and kwargs.get("sliding_window") is None
             and kwargs.get("position_bias") is None and kwargs.get("cache") is None)
    if plain and attention_mask is None and 1 < q_length < kv_length:
        out = prefix_attention(query, key, value, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if plain and attention_mask is not None and key.shape[1] < query.shape[1]:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def install(model: torch.nn.Module, text_config) -> bool:
    """Route ``text_config``'s attention (the LM of ``model``) through this module, when the model
    runs on the CPU with SDPA and torch has the flash kernel; False (and nothing changed) otherwise."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    device = next(model.parameters()).device
    if _FLASH is None or device.type != "cpu" or text_config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    text_config._attn_implementation = NAME
    log.debug("CPU attention installed (%s)", NAME)
    return True
