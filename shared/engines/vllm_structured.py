"""Structured output inside vLLM's engine core: a vLLM v1 logits processor (registered by
``VllmEngine`` as ``logits_processors``) that runs :mod:`shared.engines.structured` — the
transformers engine's own grammar code — for requests whose ``SamplingParams.extra_args``
carry ``mmfleet_structured``.

Why not vLLM's built-in ``StructuredOutputsParams``: in e-p-d / ep-d the decode engine gets the
prompt plus prefill's first token AS PROMPT, and vLLM's grammar would start again at the decode
engine's first position. This processor is told that prefix (``mmfleet_prefix``: the completion
tokens that reach vLLM as prompt) and advances the grammar over it first, so both halves of a
split request, and both engines, follow one grammar state. Imported by vLLM (by name) in the
worker and in the engine-core process; never imported without vLLM.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from shared import protocol
from shared.engines.structured import Grammars

ARG = "mmfleet_structured"  # {"kind": ..., "schema": ...}
PREFIX_ARG = "mmfleet_prefix"  # completion tokens vLLM sees as prompt
STOPS_ARG = "mmfleet_stop_ids"  # what ends the completion once the grammar is complete


def extra_args(sampling: protocol.Sampling, prefix: tuple[int, ...], stop_ids) -> dict:
    """The ``SamplingParams.extra_args`` entries for ``sampling.structured`` (empty without)."""
    if sampling.structured is None:
        return {}
    return {ARG: {"kind": sampling.structured.kind, "schema": sampling.structured.schema},
            PREFIX_ARG: [int(t) for t in prefix], STOPS_ARG: sorted(int(t) for t in stop_ids)}


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
        spec = args.get(ARG)
        if spec is None:
            return None
        grammars = self._grammars_for(tuple(args.get(STOPS_ARG, ())))
        structured = protocol.StructuredOutput(spec["kind"], spec.get("schema", ""))
        prefix = list(args.get(PREFIX_ARG, ()))
        state: dict = {"constraint": None, "seen": 0}

        def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            constraint = state["constraint"]
            if constraint is None:
                constraint = state["constraint"] = grammars.constraint(structured, logits.numel(), prefix)
            for token in output_ids[state["seen"]:]:
                constraint.accept(token)
            state["seen"] = len(output_ids)
            return constraint.mask(logits).to(logits.dtype)

        return apply
