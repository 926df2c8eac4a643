"""``protocol.Sampling`` → SGLang's ``sampling_params`` dict and logprob flags, the controls SGLang
cannot apply as the fleet's contract says refused by name (:class:`EngineError`), and SGLang's
stream chunks back as our tokens (:class:`StreamReader`). Imports no SGLang. Stop tokens are
the caller's to enforce: SGLang's ``ignore_eos`` also drops ``stop_token_ids``
(schedule_batch ``_check_token_based_finish``), the fleet's drops eos only.

Design: docs/design/sglang-engine.md.
"""

from __future__ import annotations

from shared import protocol
from shared.engines.base import EngineError, SampledToken

GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below it is greedy (top_k 1)
# raw-logit logprobs (the fleet's contract) rather than after temperature: SGLang's sampler reads it
RAW_LOGPROBS_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def refusal(sampling: protocol.Sampling) -> str | None:
    """Why SGLang cannot serve these controls as the contract says (None: it can)."""
    if sampling.max_tokens < 1:
        return f"max_tokens must be >= 1, got {sampling.max_tokens}"
    if sampling.structured is not None:
        return ("the sglang engine does not serve structured output (response_format, forced tool calls): "
                "SGLang's grammar backend is not the fleet's; use engine transformers or vllm")
    if sampling.seed is not None and sampling.temperature >= GREEDY_EPS:
        return ("the sglang engine does not take a sampling seed: SGLang 0.5.12 refuses per-request seeds on its "
                "default (flashinfer) sampler; leave seed unset or sample greedily")
    return None


def sampling_params(sampling: protocol.Sampling, already: int = 0) -> dict:
    """SGLang's ``sampling_params`` (sglang/srt/sampling/sampling_params.py's names). ``already``:
    completion tokens that reach SGLang as prompt (resumed ones), which ``min_tokens`` discounts."""
    why = refusal(sampling)
    if why:
        raise EngineError(why)
    params = {
        "max_new_tokens": int(sampling.max_tokens),
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k) if sampling.top_k > 0 else -1,
        "min_p": float(sampling.min_p),
        "presence_penalty": float(sampling.presence_penalty),
        "frequency_penalty": float(sampling.frequency_penalty),
        "repetition_penalty": float(sampling.repetition_penalty),
        "min_new_tokens": min(max(0, sampling.min_tokens - already), int(sampling.max_tokens)),
        "ignore_eos": bool(sampling.ignore_eos),
        # the caller detokenises and applies stop strings; special tokens stay in SGLang's own text
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = sorted(int(t) for t in sampling.stop_token_ids)
    if sampling.logit_bias:
        params["logit_bias"] = {str(int(t)): float(b) for t, b in sampling.logit_bias}
    return params


def logprob_args(sampling: protocol.Sampling) -> dict:
    """``async_generate``'s logprob arguments: none asked, none computed."""
    if sampling.logprobs is None:
        return {}
    return {"return_logprob": True, "top_logprobs_num": int(sampling.logprobs), "logprob_start_len": -1}


class StreamReader:
    """SGLang's stream chunks (``{"output_ids", "meta_info"}``; ``output_ids`` the whole completion so
    far, as with ``incremental_streaming_output`` off) → the tokens new in each chunk, as
    :class:`SampledToken` when logprobs were asked. A chunk whose ``finish_reason`` is an abort
    raises :class:`EngineError` with SGLang's message."""

    def __init__(self, sampling: protocol.Sampling) -> None:
        self._sampling = sampling
        self.seen = 0
        self.finished = False

    def feed(self, chunk: dict) -> list[int]:
        meta = chunk.get("meta_info") or {}
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise EngineError(f"sglang aborted the request: {reason.get('message') or reason}")
        self.finished = reason is not None
        ids = list(chunk.get("output_ids") or ())
        new = ids[self.seen:]
        start, self.seen = self.seen, max(self.seen, len(ids))
        if self._sampling.logprobs is None:
            return [int(t) for t in new]
        return [self._with_logprob(meta, start + i, int(t)) for i, t in enumerate(new)]

    def _with_logprob(self, meta: dict, i: int, token: int) -> int:
        chosen = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        if i >= len(chosen):
            raise EngineError(f"sglang returned no logprob for completion token {i}")
        logprob, tid = chosen[i][0], chosen[i][1]
        if int(tid) != token:
            raise EngineError(f"sglang's logprob {i} is of token {tid}, its output has {token}")
        top = tuple((int(t), float(lp)) for lp, t, *_ in (tops[i] if i < len(tops) and tops[i] else ())
                    )[: self._sampling.logprobs]
        return SampledToken(protocol.TokenLogprob(token, float(logprob), top))
