"""Next-token sampling from a logits vector: the transformers engine's reference of every
``protocol.Sampling`` control, in vLLM's order (:func:`sample_at`): ``logit_bias``, the stop
tokens masked below ``min_tokens``, repetition / frequency / presence penalties, then greedy
``argmax`` at ``temperature == 0`` (first index on ties, like ``generate``) or temperature,
``min_p``, ``top_k``, ``top_p`` and one draw. The draw for step ``k`` comes from a generator
seeded with (seed, k), so the same seed, history and logits give the same token whichever
process draws which step; ``seed=None`` seeds from OS entropy.

Design: docs/guide/api.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, *,
                 top_k: int = 0, min_p: float = 0.0) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self.min_p = float(min_p)
        self._seed = seed
        self._generator: torch.Generator | None = None  # made at the first draw: greedy draws none

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick the next token id from float logits of shape [vocab]."""
        logits = logits.detach().reshape(-1).to(torch.float32)
        if self.greedy:
            return greedy_pick(logits)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.min_p > 0.0 or 0 < self.top_k < probs.numel():  # (untouched otherwise: same draws as before)
            if self.min_p > 0.0:
                probs = probs.masked_fill(probs < self.min_p * probs.max(), 0.0)
            if 0 < self.top_k < probs.numel():
                probs = probs.masked_fill(probs < torch.topk(probs, self.top_k).values[-1], 0.0)
            probs = probs / probs.sum()
        if self.top_p < 1.0:
            probs = _top_p_filter(probs, self.top_p)
        return int(torch.multinomial(probs, 1, generator=self._draws()).item())

    def _draws(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator()
            if self._seed is None:
                self._generator.seed()  # OS entropy: a syscall, which a greedy token should not pay
            else:
                self._generator.manual_seed(int(self._seed))
        return self._generator


def greedy_pick(logits: torch.Tensor) -> int:
    """The first index of the largest of 1-D float ``logits`` (NaN counts as largest, as in
    ``torch.argmax``). On the CPU through NumPy: torch's CPU argmax scans a 152k vocabulary in
    ~270 us against NumPy's ~37 us (torch 2.13, one thread), and this runs per token."""
    if logits.device.type == "cpu":
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits).item())


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most-likely tokens whose mass reaches ``top_p``."""
    sorted_probs, order = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    # A token is dropped when the mass BEFORE it already reaches top_p; the top token
    # always survives.
    drop = (cumulative - sorted_probs) >= top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return filtered / filtered.sum()


def stop_token_set(sampling, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The tokens that end this request's completion: eos (unless ``ignore_eos``) and its
    ``stop_token_ids``."""
    eos = frozenset() if sampling.ignore_eos else frozenset(eos_token_ids)
    return eos | frozenset(sampling.stop_token_ids)


def continuation(sampling, resume: Sequence[int], eos_token_ids: frozenset[int]):
    """What is left of a completion an earlier attempt already streamed ``resume`` of: None when
    it is complete (its budget spent, or its last token a stop token), else ``sampling`` with the
    remaining ``max_tokens`` and its stop token set (:func:`stop_token_set`). For engines that
    continue by feeding ``resume`` back as prompt."""
    stops = stop_token_set(sampling, eos_token_ids)
    if len(resume) >= sampling.max_tokens or (resume and resume[-1] in stops):
        return None
    if resume:
        sampling = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - len(resume))
    return sampling, stops


def process_logits(logits: torch.Tensor, sampling, step: int, *, prompt_ids: Sequence[int] = (),
                   output_ids: Sequence[int] = (), stop_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """Steps 1-2 of the contract on float32 ``logits`` [vocab] (a copy when a step changes them:
    ``logits`` itself is never modified; else the float32 view itself); ``output_ids``: the
    completion's tokens before ``step``; ``stop_ids``: :func:`stop_token_set`."""
    logits = logits.detach().reshape(-1).to(torch.float32)
    if not (sampling.logit_bias or (step < sampling.min_tokens and stop_ids) or sampling.repetition_penalty != 1.0
            or ((sampling.frequency_penalty or sampling.presence_penalty) and output_ids)):
        return logits  # nothing to change: no copy (a vocabulary of floats per token)
    logits = logits.clone()
    vocab = logits.numel()
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias if t < vocab], dtype=torch.long)
        logits[ids] += torch.tensor([b for t, b in sampling.logit_bias if t < vocab], dtype=torch.float32)
    if step < sampling.min_tokens and stop_ids:
        logits[torch.tensor([t for t in stop_ids if t < vocab], dtype=torch.long)] = float("-inf")
    if sampling.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if t < vocab}), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / sampling.repetition_penalty, vals * sampling.repetition_penalty)
    if (sampling.frequency_penalty or sampling.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor([t for t in output_ids if t < vocab], dtype=torch.long),
                                minlength=vocab).to(torch.float32)
        logits -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).to(torch.float32)
    return logits


def sample_at(logits: torch.Tensor, sampling, step: int, *, prompt_ids: Sequence[int] = (),
              output_ids: Sequence[int] = (), stop_ids: frozenset[int] = frozenset()) -> int:
    """Sample completion token number ``step`` for a request with ``sampling`` parameters
    (``protocol.Sampling``), one call per completion token:

    1. ``logit_bias`` is added; while fewer than ``min_tokens`` are generated the request's stop
       tokens (:func:`stop_token_set`) are masked;
    2. penalties: ``repetition_penalty`` over prompt and completion tokens (positive logits
       divided, negative multiplied), then ``frequency_penalty`` × count and
       ``presence_penalty`` over completion tokens;
    3. ``temperature == 0`` → greedy ``argmax``, no randomness consumed; otherwise logits /
       temperature, ``min_p``, ``top_k``, ``top_p`` filtering, one draw.

    A seeded request draws step ``k`` from a generator seeded with (seed, k), not from one
    generator carried across steps: prefill samples step 0 and decode the rest, possibly in
    other processes, and the tokens must not depend on which process drew which step.
    """
    seed = None if sampling.seed is None else (int(sampling.seed) * 1_000_003 + step) % (2**63)
    logits = process_logits(logits, sampling, step, prompt_ids=prompt_ids, output_ids=output_ids,
                            stop_ids=stop_ids)
    return Sampler(sampling.temperature, sampling.top_p, seed, top_k=sampling.top_k, min_p=sampling.min_p)(logits)


def with_logprob(token: int, logits: torch.Tensor, sampling):
    """``token`` as a ``SampledToken`` carrying its logprob under the raw ``logits`` and the
    ``sampling.logprobs`` most likely tokens; the plain id when logprobs are off."""
    if sampling.logprobs is None:
        return token
    from shared import protocol
    from shared.engines.base import SampledToken

    lp = torch.log_softmax(logits.detach().reshape(-1).to(torch.float32), dim=-1)
    top = ()
    if sampling.logprobs > 0:
        values, ids = torch.topk(lp, min(sampling.logprobs, lp.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(protocol.TokenLogprob(int(token), float(lp[token]), top))


class DecodeSeq:
    """One request's side of decode after each step: the next token from a step's logits, as
    the transformers engine's ``decode`` yields them (tokens 2.. of the completion). Used on the
    worker's thread and in the decode core process alike, so both yield the same tokens.

    ``constraint_for(sampling, logits, prefix)``: the request's grammar advanced over ``prefix``
    (None without one); ``resume``: tokens 2.. of an earlier attempt, fed instead of sampled.
    ``finished``: no more steps (a stop token was yielded, ``max_tokens`` reached, or none were
    due at all)."""

    def __init__(self, sampling, eos_token_ids: frozenset[int], first_token: int, *, resume: Sequence[int] = (),
                 prompt_ids: Sequence[int] = (), constraint_for=None) -> None:
        self.sampling = sampling
        self.stops = stop_token_set(sampling, eos_token_ids)
        self.token = int(first_token)  # the token the next step feeds
        self.generated = 1
        self._outputs = [int(first_token)]
        self._resume = tuple(resume)
        self._prompt_ids = prompt_ids
        self._constraint_for = constraint_for
        self._constraint = None
        self.finished = self.token in self.stops or sampling.max_tokens <= 1

    def next(self, logits: torch.Tensor):
        """The token after a step that fed :attr:`token` (a ``SampledToken`` with logprobs on)."""
        s = self.sampling
        if self._constraint is None and s.structured is not None and self._constraint_for is not None:
            self._constraint = self._constraint_for(s, logits, prefix=self._outputs)  # continues prefill's grammar
        forced = self.generated - 1 < len(self._resume)
        allowed = logits if self._constraint is None else self._constraint.mask(logits)
        token = self._resume[self.generated - 1] if forced else with_logprob(sample_at(
            allowed, s, step=self.generated, prompt_ids=self._prompt_ids, output_ids=self._outputs,
            stop_ids=self.stops), logits, s)
        if self._constraint is not None:
            self._constraint.accept(token)
        self.generated += 1
        self._outputs.append(int(token))
        self.token = int(token)
        self.finished = self.token in self.stops or self.generated >= s.max_tokens
        return token
