"""vLLM's ``SamplingParams`` for every ``protocol.Sampling`` control, and its outputs back as
our tokens (``SampledToken`` with logprobs when asked). Controls apply as in the transformers
reference (``shared.engines.sampling``); a structured output's grammar and the presence /
frequency penalties over tokens that reach vLLM as prompt run in ``shared.engines.vllm_structured``.

Design: docs/design/vllm-engine.md.
"""

from __future__ import annotations

from shared import protocol
from shared.engines.base import EngineError, SampledToken
from shared.engines.sampling import stop_token_set


def sampling_params(sampling: protocol.Sampling, eos_token_ids, kv_transfer: dict | None = None, already: int = 0,
                    prefix: tuple[int, ...] = ()):
    """vLLM's params for every ``protocol.Sampling`` control. ``already``: completion tokens
    that reach vLLM as prompt (prefill's first token, resumed ones), which ``min_tokens``
    discounts; ``prefix``: those tokens, over which a structured output's grammar is advanced
    first, and for which presence / frequency penalties are added (vLLM's own count only the
    tokens IT generated), both by ``shared.engines.vllm_structured``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if sampling.max_tokens < 1:
        raise EngineError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
    return SamplingParams(
        n=1,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        seed=sampling.seed,
        max_tokens=int(sampling.max_tokens),
        top_k=int(sampling.top_k),
        min_p=float(sampling.min_p),
        presence_penalty=float(sampling.presence_penalty),
        frequency_penalty=float(sampling.frequency_penalty),
        repetition_penalty=float(sampling.repetition_penalty),
        logit_bias=dict(sampling.logit_bias) or None,
        min_tokens=min(max(0, sampling.min_tokens - already), int(sampling.max_tokens)),
        # eos travels as stop_token_ids (see vllm_engine), so ignore_eos drops it there
        ignore_eos=bool(sampling.ignore_eos),
        stop_token_ids=sorted(stop_token_set(sampling, eos_token_ids)),
        logprobs=sampling.logprobs,  # raw logprobs (vLLM's default logprobs_mode), like transformers'
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,  # the caller detokenises (and applies stop strings)
        extra_args={**({"kv_transfer_params": kv_transfer} if kv_transfer is not None else {}),
                    **structured_args(sampling, prefix, stop_token_set(sampling, eos_token_ids))} or None,
    )


def sampled(completion, i: int, sampling: protocol.Sampling) -> int:
    """Token ``i`` of a DELTA output: the id, or with ``sampling.logprobs`` a ``SampledToken``
    carrying vLLM's logprob of it and the ``logprobs`` most likely tokens (by vLLM's rank)."""
    token = int(completion.token_ids[i])
    if sampling.logprobs is None or not completion.logprobs:
        return token
    ranked = completion.logprobs[i]
    top = sorted(((int(t), lp) for t, lp in ranked.items() if lp.rank is not None and lp.rank <= sampling.logprobs),
                 key=lambda item: item[1].rank)
    return SampledToken(protocol.TokenLogprob(token, float(ranked[token].logprob),
                                              tuple((t, float(lp.logprob)) for t, lp in top)))


def structured_args(sampling: protocol.Sampling, prefix: tuple[int, ...], stop_ids) -> dict:
    if sampling.structured is None and not (prefix and (sampling.presence_penalty or sampling.frequency_penalty)):
        return {}
    from shared.engines import vllm_structured  # imports vLLM: only for requests that need it

    return vllm_structured.extra_args(sampling, prefix, stop_ids)
