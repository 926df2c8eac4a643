"""Attention for a prefill that continues a cached prefix, without a materialised mask (CPU).

A follow-up turn that hits its prefix computes only its new positions: each attends to every
cached position and causally to the new ones. transformers builds a [new, all] boolean mask for
that and SDPA then computes every block, masked or not, at a cost per block above the unmasked
kernel. Here the two parts run apart through torch's CPU flash kernel (the cached part unmasked,
the new part with ``is_causal``) and are merged by their log-sum-exp: the same result to float
rounding, no mask to build. Measured in the README ("Prefix-hit prefill").

``install(model)`` points the language model's attention at :data:`NAME`; every other call
(a fresh prompt, a decode step, a padded batch, any device but the CPU) goes to transformers'
own SDPA path unchanged, because the mask function returns a mask for all of them.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

NAME = "mmfleet_prefix_sdpa"
# private but stable since torch 2.3: (output, logsumexp, ...); the public SDPA hides the LSE
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _is_prefix_causal(q_length: int, kv_length: int, q_offset: int, kv_offset: int, mask_function,
                      attention_mask: torch.Tensor | None, local_size: int | None) -> bool:
    """True when the mask would be exactly "all of the cache, then causal", with a cache."""
    from transformers.masking_utils import causal_mask_function

    return (mask_function is causal_mask_function and local_size is None and kv_offset == 0
            and 1 < q_length < kv_length and q_offset + q_length == kv_length
            and (attention_mask is None or bool(attention_mask.all())))


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
          mask_function=None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
          allow_is_causal_skip: bool = True, **kwargs):
    """transformers' SDPA mask, except None for a prefix continuation (see the module contract)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    if allow_is_causal_skip and _is_prefix_causal(q_length, kv_length, q_offset, kv_offset, mask_function,
                                                  attention_mask, local_size):
        return None
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
    if (attention_mask is None and 1 < q_length < kv_length and not dropout and query.device.type == "cpu"
            and kwargs.get("sliding_window") is None and kwargs.get("position_bias") is None):
        out = prefix_attention(query, key, value, scale=scaling)
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
    log.debug("prefix-continuation attention installed (%s)", NAME)
    return True
