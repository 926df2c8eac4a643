"""The sampling controls of ``protocol.Sampling`` in the transformers reference
(shared.engines.sampling): each one's effect on hand-computed logits, and on the tiny model a
seeded, penalised, biased request gives the same tokens whether one engine generates it or one
engine prefills and another decodes it (the E/P/D split), with stop tokens honoured the same way."""

from __future__ import annotations

import math

import pytest
import torch

from shared import protocol
from shared.engines.sampling import process_logits, sample_at, stop_token_set

S = protocol.Sampling


def test_logit_bias_is_added():
    out = process_logits(torch.zeros(5), S(logit_bias=((1, 3.0), (4, -2.5))), 0)
    assert out.tolist() == [0.0, 3.0, 0.0, 0.0, -2.5]


def test_min_tokens_masks_stop_tokens_until_reached():
    stops = stop_token_set(S(stop_token_ids=(2,)), frozenset({4}))
    assert stops == {2, 4}
    early = process_logits(torch.zeros(5), S(min_tokens=2), 1, stop_ids=stops)
    assert math.isinf(early[2]) and math.isinf(early[4]) and early[0] == 0
    assert process_logits(torch.zeros(5), S(min_tokens=2), 2, stop_ids=stops).tolist() == [0.0] * 5


def test_a_plain_greedy_token_copies_no_logits_and_draws_no_entropy():
    """Per decode token on the event loop: no vocabulary-sized copy when no control changes the
    logits, and a greedy pick makes no generator (seeding one from OS entropy is a syscall); the
    caller's logits are never modified, whichever path."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    assert process_logits(logits, S(), 3).data_ptr() == logits.data_ptr()
    biased = process_logits(logits, S(logit_bias=((0, 9.0),)), 3)
    assert biased.data_ptr() != logits.data_ptr() and logits.tolist() == [0.5, 3.0, -1.0, 2.0]
    from shared.engines.sampling import Sampler

    greedy = Sampler(temperature=0.0)
    assert greedy(logits) == 1 and greedy._generator is None
    drawn = Sampler(temperature=1.0, seed=5)
    drawn(logits)
    assert drawn._generator is not None
    assert sample_at(logits, S(temperature=0.0), 1) == 1


@pytest.mark.parametrize("values", [
    [1.0, 3.0, 3.0, 2.0],  # a tie: the first index, like generate()
    [float("-inf"), float("-inf"), -5.0],
    [0.0, float("nan"), 9.0, float("nan")],  # NaN counts as the largest, as in torch.argmax
    [float("inf"), 1.0, float("inf")],
])
def test_the_greedy_pick_is_torchs_argmax(values):
    from shared.engines.sampling import greedy_pick

    logits = torch.tensor(values)
    assert greedy_pick(logits) == int(torch.argmax(logits))
    wide = torch.randn(151_936)
    assert greedy_pick(wide) == int(torch.argmax(wide))
    assert greedy_pick(wide[::2]) == int(torch.argmax(wide[::2]))  # a strided view too


def test_ignore_eos_leaves_only_stop_token_ids():
    assert stop_token_set(S(ignore_eos=True, stop_token_ids=(3,)), frozenset({4})) == {3}


def test_penalties_follow_vllms_formulas():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = process_logits(logits, S(repetition_penalty=2.0), 0, prompt_ids=[0], output_ids=[1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied; prompt counts
    pen = process_logits(logits, S(frequency_penalty=0.5, presence_penalty=0.25), 3, prompt_ids=[3],
                         output_ids=[2, 2, 0])
    assert pen.tolist() == [2.0 - 0.5 - 0.25, -2.0, 1.0 - 1.0 - 0.25, 0.5]  # the prompt does not count


def test_top_k_1_and_min_p_1_are_greedy_and_seeds_repeat_per_step():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    best = int(torch.argmax(logits))
    assert {sample_at(logits, S(temperature=1.0, top_k=1), k) for k in range(20)} == {best}
    assert {sample_at(logits, S(temperature=1.0, min_p=1.0), k) for k in range(20)} == {best}
    seeded = S(temperature=1.5, top_k=20, min_p=0.01, seed=7)
    draws = [sample_at(logits, seeded, k) for k in range(30)]
    assert draws == [sample_at(logits, seeded, k) for k in range(30)]
    assert len(set(draws)) > 1  # steps draw differently: the step index is in the seed



async def test_seeded_controls_equal_in_one_engine_and_split(engines):
    gen, dec = engines
    prompt = gen.compute.render_prompt_ids([{"role": "user", "content": "Tell me a story about the sea."}])
    sampling = S(max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, min_p=0.02, seed=1234,
                 presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias=((11, 2.0),),
                 min_tokens=5, ignore_eos=True, logprobs=2)
    whole = [t async for t in gen.generate("w", prompt, [], sampling)]
    out = await gen.prefill("p", prompt, [], sampling)
    split = [out.first_token] + [t async for t in dec.decode("d", out.kv, out.rope_delta, out.prompt_len,
                                                             out.first_token, sampling, prompt_ids=tuple(prompt))]
    assert whole == split and len(whole) == 24  # ignore_eos: runs to max_tokens
    # logprobs (raw logits) ride on the tokens: the same in both, top 2 first by value
    assert [t.logprob.token_id for t in whole] == whole
    for a, b in zip(whole, split, strict=True):
        assert a.logprob.logprob == pytest.approx(b.logprob.logprob, abs=1e-4)
        assert [i for i, _ in a.logprob.top] == [i for i, _ in b.logprob.top] and len(a.logprob.top) == 2
        assert a.logprob.top[0][1] >= a.logprob.top[1][1] and a.logprob.logprob <= a.logprob.top[0][1]
    plain = [t async for t in gen.generate("x", prompt, [], S(max_tokens=24, temperature=0.9, top_p=0.95,
                                                                seed=1234, ignore_eos=True))]
    assert plain != whole  # the controls changed the draw


async def test_stop_token_ids_end_the_completion(engines):
    gen, _ = engines
    prompt = gen.compute.render_prompt_ids([{"role": "user", "content": "Count with me."}])
    greedy = [t async for t in gen.generate("g", prompt, [], S(max_tokens=12, temperature=0.0, ignore_eos=True))]
    stop = greedy[4]
    cut = [t async for t in gen.generate("s", prompt, [], S(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                              stop_token_ids=(stop,)))]
    assert cut == greedy[: greedy.index(stop) + 1]  # the engine yields the stop token and ends
    banned = [t async for t in gen.generate("b", prompt, [], S(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                                 logit_bias=((stop, -100.0),)))]
    assert stop not in banned


def test_vllm_prefix_penalties_compose_to_the_reference():
    """vLLM's decode engine gets prefill's token (and resumed ones) as prompt: the processor's
    compensation, followed by vLLM's own repetition and output-token penalties (simulated here
    with vLLM's formulas), gives the transformers engine's logits."""
    pytest.importorskip("vllm")
    from shared.engines.vllm_structured import prefix_penalties

    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 3
    prompt, prefix, outputs = [1, 2, 3], [5, 7, 5], [7, 9, 9]
    s = S(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3)
    want = process_logits(logits, s, 6, prompt_ids=prompt, output_ids=prefix + outputs)

    x = prefix_penalties(logits, prefix, outputs, s.presence_penalty, s.frequency_penalty, s.repetition_penalty)
    seen = sorted(set(prompt + prefix + outputs))  # vLLM: prefix tokens are prompt to it
    x[seen] = torch.where(x[seen] > 0, x[seen] / 1.3, x[seen] * 1.3)
    counts = torch.bincount(torch.tensor(outputs), minlength=40).float()
    x -= 0.4 * counts + 0.7 * (counts > 0).float()
    assert torch.allclose(x, want, atol=1e-5)


def test_continuation_after_an_earlier_attempts_tokens():
    from shared import protocol
    from shared.engines.sampling import continuation

    s = protocol.Sampling(max_tokens=5, temperature=0.0, stop_token_ids=(9,))
    assert continuation(s, (), frozenset({2})) == (s, frozenset({2, 9}))
    assert continuation(s, (4, 5), frozenset({2}))[0].max_tokens == 3
    assert continuation(s, (4, 2), frozenset({2})) is None  # ended on eos
    assert continuation(s, (4, 9), frozenset({2})) is None  # on a stop token
    assert continuation(s, (1, 1, 1, 1, 1), frozenset({2})) is None  # budget spent
    ignoring = protocol.Sampling(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert continuation(ignoring, (4, 2), frozenset({2}))[0].max_tokens == 3
