"""The LM's CPU attention (shared.engines.cpu_attention): the prefix-continuation path equals
transformers' masked SDPA and is used only where the mask is "all of the cache, then causal";
the masked grouped-KV path equals transformers' (``repeat_kv``) call; both are installed on the
Qwen2-VL engine, a long prefix-hit prefill takes the split with the full prefill's logits (here),
and batched decode takes the grouped-KV path, its padding mask as the mask, with lone steps' logits
(here) and generate()'s tokens (test_engine_batched)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from shared.engines import cpu_attention
from shared.engines.qwen2_vl import Qwen2VLCompute

F = torch.nn.functional


@pytest.mark.parametrize("heads,kv_heads,q,kv", [(4, 2, 37, 101), (4, 4, 5, 9), (8, 2, 2, 3), (2, 1, 64, 65)])
def test_equals_masked_sdpa(heads, kv_heads, q, kv):
    gen = torch.Generator().manual_seed(q)
    query = torch.randn(2, q, heads, 16, generator=gen).transpose(1, 2)  # as the layers hand it over
    key, value = (torch.randn(2, kv_heads, kv, 16, generator=gen) for _ in range(2))
    g = heads // kv_heads
    mask = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)
    ref = F.scaled_dot_product_attention(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1),
                                         attn_mask=mask, scale=0.3)
    out = cpu_attention.prefix_attention(query, key, value, scale=0.3)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=1e-5)


def _masks(**kw):
    args = dict(batch_size=1, mask_function=causal_mask_function, allow_is_causal_skip=True) | kw
    return cpu_attention._mask(**args), sdpa_mask(**args)


def test_no_mask_only_for_a_prefix_continuation():
    ours, theirs = _masks(q_length=300, kv_length=700, q_offset=400)
    assert ours is None and theirs is not None and theirs[0, 0].equal(torch.ones(300, 700, dtype=torch.bool).tril(400))
    # anything else: transformers' own answer (a mask, or None where it would skip it too)
    for kw in (dict(q_length=700, kv_length=700), dict(q_length=1, kv_length=700, q_offset=699),
               dict(q_length=5, kv_length=12, q_offset=7),  # too small for the split to pay
               dict(q_length=300, kv_length=700, q_offset=400, attention_mask=torch.tensor([[0] + [1] * 699]).bool()),
               dict(q_length=300, kv_length=700, q_offset=400, allow_is_causal_skip=False),
               dict(q_length=300, kv_length=700, q_offset=400, local_size=64)):
        ours, theirs = _masks(**kw)
        assert (ours is None and theirs is None) or ours.equal(theirs), kw


def test_masked_grouped_kv_equals_repeated_heads():
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(3, 1, 4, 16, generator=gen).transpose(1, 2)  # a decode step of 3 sequences
    key, value = (torch.randn(3, 2, 40, 16, generator=gen) for _ in range(2))
    mask = torch.ones(3, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :25] = False  # left padding of the shorter ones
    mask[2, ..., :7] = False
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    ours, _ = cpu_attention._attention(module, query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert ours.shape == theirs.shape and torch.allclose(ours, theirs, atol=1e-6)


def test_installed_on_the_engine_and_used_by_prefix_hits_only(model_dir, monkeypatch):
    compute = Qwen2VLCompute(model_dir)
    assert compute.model.config.text_config._attn_implementation == cpu_attention.NAME
    assert compute.model.config.vision_config._attn_implementation != cpu_attention.NAME
    calls = []
    real = cpu_attention.prefix_attention
    monkeypatch.setattr(cpu_attention, "prefix_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = compute.render_prompt_ids([{"role": "user", "content": " ".join(f"w{i}" for i in range(400))}])
    assert len(ids) * (len(ids) - 4) >= cpu_attention.SPLIT_MIN_PAIRS
    full = compute.prefill(ids, [])
    state = compute.start_decode(full.kv, full.rope_delta, full.prompt_len)
    compute.decode_step(state, int(full.last_logits.argmax()))
    assert calls == []  # a fresh prompt and a decode step keep transformers' path
    hit = compute.prefill(ids, [], prefix_kv=full.kv[:, :, :, :4].contiguous())
    assert len(calls) == compute.n_layers
    assert torch.allclose(hit.last_logits, full.last_logits, atol=1e-4)


def test_a_padded_decode_steps_mask_is_its_padding_mask():
    padding = torch.ones(3, 40, dtype=torch.bool)
    padding[0, :25] = False  # left padding of the shorter sequences
    padding[2, :7] = False
    ours, theirs = _masks(batch_size=3, q_length=1, kv_length=40, q_offset=39, attention_mask=padding)
    assert ours.shape == theirs.shape == (3, 1, 1, 40) and ours.equal(theirs)
    # not a padded step: transformers' own answer (no padding, a prefill, an offset, a window)
    for kw in (dict(attention_mask=torch.ones(3, 40, dtype=torch.bool)), dict(q_length=2, q_offset=38),
               dict(q_offset=30), dict(local_size=8)):
        args = dict(batch_size=3, q_length=1, kv_length=40, q_offset=39, attention_mask=padding) | kw
        assert not cpu_attention._is_padded_step(args["q_length"], 40, args["q_offset"], 0, causal_mask_function,
                                                 args["attention_mask"], args.get("local_size"))
        ours, theirs = _masks(**args)
        assert (ours is None and theirs is None) or ours.equal(theirs), kw


def test_a_batched_decode_step_takes_the_padding_mask_with_lone_steps_logits(model_dir, monkeypatch):
    from shared.engines.batched import decode_steps

    compute = Qwen2VLCompute(model_dir)
    taken = []
    real = cpu_attention._is_padded_step
    monkeypatch.setattr(cpu_attention, "_is_padded_step", lambda *a: taken.append(real(*a)) or taken[-1])
    batch, lone = [], []
    for words in (3, 30):  # two lengths: the shorter one is padded in the batch
        pre = compute.prefill(compute.render_prompt_ids([{"role": "user", "content": "sea " * words}]), [])
        first = int(pre.last_logits.argmax())
        batch.append((compute.start_decode(pre.kv.clone(), pre.rope_delta, pre.prompt_len), first))
        lone.append(compute.decode_step(compute.start_decode(pre.kv.clone(), pre.rope_delta, pre.prompt_len), first))
    stepped = decode_steps(compute, batch)
    assert any(taken)
    for a, b in zip(stepped, lone, strict=True):
        assert torch.allclose(a, b, atol=1e-4)
