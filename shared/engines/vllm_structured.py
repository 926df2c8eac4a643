"""What vLLM's sampler cannot do alone: a vLLM v1 logits processor (``VllmEngine`` registers it as
``logits_processors``; imported only with vLLM, in the worker and the engine core) that runs per
request from ``SamplingParams.extra_args``: ``mmfleet_structured`` (the transformers engine's
grammar code, :mod:`shared.engines.structured`, advanced first over ``mmfleet_prefix``, the
completion tokens that reach vLLM as prompt, so both halves of a split request follow one grammar
state, where vLLM's own structured output would start again at decode) and ``mmfleet_penalties``
(presence / frequency penalties for those prefix tokens, which vLLM's own penalties miss).

Design: docs/design/vllm-engine.md.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from shared import protocol
from shared.engines.structured import Grammars

ARG = "mmfleet_structured"  # {"kind": ..., "schema": ...}
PREFIX_ARG = "mmfleet_prefix"  # completion tokens vLLM sees as prompt
STOPS_ARG = "mmfleet_stop_ids"  # what ends the completion once the grammar is complete
PENALTIES_ARG = "mmfleet_penalties"  # [presence, frequency, repetition] for the prefix tokens


def extra_args(sampling: protocol.Sampling, prefix: tuple[int, ...], stop_ids) -> dict:
    """The ``SamplingParams.extra_args`` entries this processor needs (empty: none)."""
    out: dict = {}
    if sampling.structured is not None:
        out[ARG] = {"kind": sampling.structured.kind, "schema": sampling.structured.schema}
        out[STOPS_ARG] = sorted(int(t) for t in stop_ids)
    if prefix and (sampling.presence_penalty or sampling.frequency_penalty):
        out[PENALTIES_ARG] = [sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty]
    if out:
        out[PREFIX_ARG] = [int(t) for t in prefix]
    return out


def prefix_penalties(logits: torch.Tensor, prefix: list[int], output_ids: list[int], presence: float,
                     frequency: float, repetition: float) -> torch.Tensor:
    """``logits`` with each prefix token's value pre-compensated: vLLM applies repetition and then
    its penalties AFTER this processor, so a prefix token's logit x is set to rep⁻¹(rep(x) −
    extra); after vLLM's steps it is exactly the transformers engine's rep(x) − presence·[seen] −
    frequency·count."""
    counts: dict[int, int] = {}
    for t in prefix:
        counts[t] = counts.get(t, 0) + 1
    seen_out = set(output_ids)
    logits = logits.clone()
    for t, n in counts.items():
        if t >= logits.numel():
            continue
        x = float(logits[t])
        extra = frequency * n + (presence if t not in seen_out else 0.0)
        v = (x / repetition if x > 0 else x * repetition) - extra
        logits[t] = v * repetition if v > 0 else v / repetition
    return logits


class StructuredOutputProcessor(AdapterLogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self._tokenizer_path = vllm_config.model_config.tokenizer
        self._grammars: dict[tuple[int, ...], Grammars] = {}  # by stop ids (one per model in practice)
        self._tokenizer = None

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely

    def _grammars_for(self, stops: tuple[int, ...]) -> Grammars:
        grammars = self._grammars.get(stops)
        if grammars is None:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
            grammars = self._grammars[stops] = Grammars(self._tokenizer, stops)
        return grammars

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        spec, penalties = args.get(ARG), args.get(PENALTIES_ARG)
        if spec is None and penalties is None:
            return None
        prefix = list(args.get(PREFIX_ARG, ()))
        grammars = self._grammars_for(tuple(args.get(STOPS_ARG, ()))) if spec is not None else None
        structured = protocol.StructuredOutput(spec["kind"], spec.get("schema", "")) if spec is not None else None
        state: dict = {"constraint": None, "seen": 0}

        def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            out = logits
            if penalties is not None:
                out = prefix_penalties(out, prefix, output_ids, *penalties)
            if structured is not None:
                constraint = state["constraint"]
                if constraint is None:
                    constraint = state["constraint"] = grammars.constraint(structured, logits.numel(), prefix)
                for token in output_ids[state["seen"]:]:
                    constraint.accept(token)
                state["seen"] = len(output_ids)
                out = constraint.mask(out)
            return out.to(logits.dtype)

        return apply
