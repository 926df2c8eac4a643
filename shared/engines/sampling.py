"""Next-token sampling from a logits vector.

Contract: ``Sampler(temperature, top_p, seed)`` belongs to ONE request.
- ``temperature == 0`` → greedy: ``argmax`` (first index on ties, like ``generate``);
  no randomness is consumed.
- otherwise logits / temperature, nucleus (top_p) filtering, then one draw from a
  private ``torch.Generator`` seeded with ``seed``: the same seed and the same logits
  sequence give the same tokens, independent of other requests and of torch's
  global RNG.  ``seed=None`` seeds from OS entropy (not reproducible).
"""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick the next token id from float logits of shape [vocab]."""
        logits = logits.detach().reshape(-1).to(torch.float32)
        if self.greedy:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1.0:
            probs = _top_p_filter(probs, self.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator).item())


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


def sample_at(logits: torch.Tensor, sampling, step: int) -> int:
    """Sample completion token number ``step`` for a request with ``sampling`` parameters
    (``protocol.Sampling``).

    A seeded request draws step ``k`` from a generator seeded with (seed, k), not from one
    generator carried across steps: prefill samples step 0 and decode the rest, possibly in
    other processes, and the tokens must not depend on which process drew which step.
    """
    seed = None if sampling.seed is None else (int(sampling.seed) * 1_000_003 + step) % (2**63)
    return Sampler(sampling.temperature, sampling.top_p, seed)(logits)
