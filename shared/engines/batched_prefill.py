"""Batched prefill: several fresh prompts in ONE forward (:func:`prefill_many`), grouped by
length and right-padded to each group's longest prompt; under a causal mask no real position
sees the padding, so SDPA keeps its causal kernel. Greedy tokens equal one-prompt-per-forward
prefill (``tests/unit/test_prefill_batched.py``).

Design: docs/design/overhead.md.
"""

from __future__ import annotations

import torch

from shared import metrics

# a group's padded positions may exceed its prompts' own by this fraction: padding costs compute
# (the MLPs are linear in positions), one forward instead of several saves per-call overhead
PAD_WASTE = 0.25
MAX_GROUP_POSITIONS = 16384  # bounds one forward's activations and KV (padded positions)


def _groups(lens: list[int]) -> list[list[int]]:
    """Indices into ``lens``, grouped: ascending length, each group's padded size (count × its
    longest) within ``1 + PAD_WASTE`` of its real positions and ``MAX_GROUP_POSITIONS``."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        group = groups[-1] if groups else None
        if group is not None:
            padded = (len(group) + 1) * lens[i]  # i is the longest so far
            if padded <= (1 + PAD_WASTE) * (real + lens[i]) and padded <= MAX_GROUP_POSITIONS:
                group.append(i)
                real += lens[i]
                continue
        groups.append([i])
        real = lens[i]
    return groups


def prefill_many(compute, items: list[tuple]) -> list:
    """``items`` = ``(prompt_ids, media, prefix_kv)`` per request; returns one ``PrefillResult``
    each, in order, or the exception that request alone raised (a bad prompt fails its caller, not
    its batch-mates). Runs on the compute lane.

    A prompt that continues a cached prefix, every prompt of a family without ``prefill_inputs``,
    and a lone fresh prompt run the family's own ``prefill`` alone. Fresh prompts are grouped by
    length (sorted; a group holds at most ``PAD_WASTE`` more positions than its prompts have) and
    each group runs as one forward. Positions are each prompt's own (M-RoPE included); each
    prompt's logits are read at its own last position and its KV cut to its length."""
    results: list = [None] * len(items)
    fresh: list[int] = []
    for i, (prompt_ids, media, prefix_kv) in enumerate(items):
        if prefix_kv is not None or not hasattr(compute, "prefill_inputs"):
            results[i] = _alone(compute, prompt_ids, media, prefix_kv)
        else:
            fresh.append(i)
    if len(fresh) == 1:
        i = fresh[0]
        results[i] = _alone(compute, items[i][0], items[i][1], None)
        return results
    inputs: dict[int, tuple] = {}
    for i in fresh:
        try:
            inputs[i] = compute.prefill_inputs(items[i][0], items[i][1])
        except Exception as exc:  # this prompt's own fault (e.g. placeholders ≠ media)
            results[i] = exc
    ready = list(inputs)
    for group in _groups([inputs[i][0].shape[0] for i in ready]):
        members = [ready[g] for g in group]
        try:
            if len(members) == 1:
                results[members[0]] = _alone(compute, items[members[0]][0], items[members[0]][1], None)
            else:
                for i, result in zip(members, _forward(compute, [inputs[i] for i in members]), strict=True):
                    results[i] = result
        except Exception as exc:
            for i in members:
                results[i] = exc
    return results


def _alone(compute, prompt_ids, media, prefix_kv):
    metrics.PREFILL_BATCH.observe(1)
    try:
        return compute.prefill(prompt_ids, media) if prefix_kv is None else compute.prefill(prompt_ids, media,
                                                                                             prefix_kv)
    except Exception as exc:
        return exc


@torch.inference_mode()
def _forward(compute, inputs: list[tuple]) -> list:
    """One forward over ``inputs`` = ``(embeds [L, H], positions [..., 1, L], rope_delta)`` each."""
    from shared.engines.kv_pack import pack_kv
    from shared.engines.qwen2_vl import PrefillResult

    lens = [embeds.shape[0] for embeds, _, _ in inputs]
    # a width equal to the batch size would make logits of every position indistinguishable from
    # the kept ones (below); one more padding column avoids it
    width = max(lens) + (max(lens) == len(inputs))
    embeds = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, width - n)) for (e, _, _), n in
                          zip(inputs, lens, strict=True)])
    # padding's positions continue its prompt's last one; no real position attends to them
    positions = torch.cat([torch.cat([p, p[..., -1:].expand(*p.shape[:-1], width - n)], dim=-1)
                           for (_, p, _), n in zip(inputs, lens, strict=True)], dim=-2)
    last = torch.tensor([n - 1 for n in lens], device=embeds.device)
    out = compute.model(inputs_embeds=embeds, position_ids=positions, past_key_values=compute.new_cache(),
                        use_cache=True, logits_to_keep=last)
    metrics.PREFILL_BATCH.observe(len(inputs))
    rows = torch.arange(len(inputs), device=last.device)
    # logits at the kept positions ([B, B, vocab]); a model that ignores logits_to_keep
    # (Qwen2-Audio's) gives every position ([B, width, vocab]): read each prompt's last then
    kept = out.logits.shape[1] != width
    logits = out.logits[rows, rows if kept else last].to("cpu", torch.float32)
    return [PrefillResult(last_logits=logits[b], kv=pack_kv(out.past_key_values, row=b, length=n),
                          rope_delta=rope_delta, prompt_len=n)
            for b, ((_, _, rope_delta), n) in enumerate(zip(inputs, lens, strict=True))]

