"""Grammar-constrained decoding (``protocol.Sampling.structured``) with xgrammar, the same code in
every engine: the transformers engine calls it around its sampler, vLLM's engine core through
:mod:`shared.engines.vllm_structured`. :meth:`Grammars.constraint` gives a :class:`Constraint`
already advanced over ``prefix`` (completion tokens drawn elsewhere: prefill's first token, a
resumed attempt's), so decode continues the grammar where prefill left it; :meth:`Constraint.mask`
sets every token the grammar does not allow next to ``-inf``. JSON is compact (no free
whitespace), so a model not trained for JSON cannot stall in endless whitespace.

Design: docs/guide/api.md.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence

import torch

from shared import protocol

log = logging.getLogger(__name__)
MAX_CACHED_GRAMMARS = 64  # compiled grammars kept per process (a few KiB to a few MiB each)


class GrammarError(ValueError):
    """The request's grammar cannot be built (bad JSON Schema, unsupported keyword)."""


def check(spec: protocol.StructuredOutput) -> None:
    """Validate ``spec`` without a tokenizer (the gateway's 400); raises :class:`GrammarError`."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.schema, any_whitespace=False)
        elif spec.kind != "json_object":
            raise GrammarError(f"unknown structured output kind {spec.kind!r}")
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(_message(exc)) from None


def _message(exc: Exception) -> str:
    """xgrammar's error without its C++ source location prefix."""
    first = (str(exc).splitlines() or [""])[0]
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first)[:300]


class Constraint:
    """One request's grammar state."""

    def __init__(self, matcher, vocab_size: int, bitmask_vocab: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = matcher
        self._vocab = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, bitmask_vocab)
        self.failed = False  # a token the grammar refused was forced in (a resumed log): stop constraining

    def accept(self, token: int) -> None:
        if self.failed or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(int(token)):
            log.warning("token %d does not fit the request's grammar; no longer constraining it", token)
            self.failed = True

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` [vocab] with the tokens the grammar forbids next at ``-inf``."""
        logits = logits.detach().reshape(-1).to(torch.float32).clone()
        if self.failed:
            return logits
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits[None], self._bitmask.to(logits.device), vocab_size=self._vocab)
        return logits


class Grammars:
    """One per engine (process): the tokenizer's xgrammar view and a bounded cache of compiled
    grammars. ``stop_token_ids``: what ends a completion (eos) — allowed once the grammar is done."""

    def __init__(self, tokenizer, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._stops = sorted(int(t) for t in stop_token_ids)
        self._compilers: dict[int, object] = {}
        self._cache: OrderedDict[tuple, object] = OrderedDict()

    def _compiler(self, vocab_size: int):
        import xgrammar as xgr

        comp = self._compilers.get(vocab_size)
        if comp is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=self._stops or None)
            comp = self._compilers[vocab_size] = xgr.GrammarCompiler(info, max_threads=1)
        return comp

    def constraint(self, spec: protocol.StructuredOutput, vocab_size: int, prefix: Sequence[int] = ()) -> Constraint:
        """``vocab_size``: the width of the model's logits (may exceed the tokenizer's)."""
        import xgrammar as xgr

        key = (vocab_size, spec.kind, spec.schema)
        compiled = self._cache.get(key)
        if compiled is None:
            comp = self._compiler(vocab_size)
            schema = spec.schema if spec.kind == "json_schema" else json.dumps({"type": "object"})
            try:
                compiled = comp.compile_json_schema(schema, any_whitespace=False)
            except (RuntimeError, ValueError, TypeError) as exc:
                raise GrammarError(_message(exc)) from None
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        c = Constraint(xgr.GrammarMatcher(compiled), vocab_size, vocab_size)
        for token in prefix:
            c.accept(token)
        return c


class LazyGrammars:
    """An engine's :class:`Grammars`, built on its first structured-output request:
    ``self(sampling, logits, prefix)`` is the request's constraint advanced over ``prefix``, or
    None for a request without a grammar. ``model_of()``: (tokenizer, stop token ids), asked for
    then, once (an engine's model may not be loaded when this is made)."""

    def __init__(self, model_of) -> None:
        self._model_of = model_of
        self._grammars: Grammars | None = None

    def __call__(self, sampling: protocol.Sampling, logits, prefix: Sequence[int] = ()) -> Constraint | None:
        if sampling.structured is None:
            return None
        if self._grammars is None:
            tokenizer, stops = self._model_of()
            self._grammars = Grammars(tokenizer, sorted(stops))
        return self._grammars.constraint(sampling.structured, logits.numel(), prefix)
