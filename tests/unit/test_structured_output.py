"""Structured output (shared.engines.structured, xgrammar) in the transformers engine: with the
random demo model, sampled completions under a JSON Schema parse and validate, the same tokens
whether one engine generates or prefill and decode run apart (decode continues the grammar after
prefill's first token), and a bad schema is a GrammarError the gateway turns into a 400."""

from __future__ import annotations

import json

import jsonschema
import pytest

from shared import protocol
from shared.engines.structured import GrammarError, check

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}}}



def _text(engine, tokens) -> str:
    return engine.tokenizer.decode([t for t in tokens if t not in engine.eos_token_ids], skip_special_tokens=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_schema_output_validates_in_one_engine_and_split(engines, seed):
    gen, dec = engines
    prompt = gen.compute.render_prompt_ids([{"role": "user", "content": "Who are you?"}])
    sampling = protocol.Sampling(max_tokens=120, temperature=1.0, seed=seed,
                                 structured=protocol.StructuredOutput("json_schema", json.dumps(SCHEMA)))
    whole = [t async for t in gen.generate(f"w{seed}", prompt, [], sampling)]
    assert whole[-1] in gen.eos_token_ids  # the grammar completed, then only eos was allowed
    jsonschema.validate(json.loads(_text(gen, whole)), SCHEMA)
    out = await gen.prefill(f"p{seed}", prompt, [], sampling)
    split = [out.first_token] + [t async for t in dec.decode(f"d{seed}", out.kv, out.rope_delta, out.prompt_len,
                                                             out.first_token, sampling, prompt_ids=tuple(prompt))]
    assert split == whole


async def test_json_object_output_parses(engines):
    gen, _ = engines
    prompt = gen.compute.render_prompt_ids([{"role": "user", "content": "JSON please"}])
    tok = gen.tokenizer
    # nothing bounds an object's length and the random model never closes one by itself: nudge
    # the closing characters (the grammar still decides what is allowed)
    nudge = tuple((tok.convert_tokens_to_ids(c), 8.0) for c in ('"', "}"))
    sampling = protocol.Sampling(max_tokens=200, temperature=1.0, seed=5, logit_bias=nudge,
                                 structured=protocol.StructuredOutput("json_object"))
    tokens = [t async for t in gen.generate("o", prompt, [], sampling)]
    assert tokens[-1] in gen.eos_token_ids
    assert isinstance(json.loads(_text(gen, tokens)), dict)


def test_bad_schemas_are_grammar_errors():
    check(protocol.StructuredOutput("json_schema", json.dumps(SCHEMA)))
    with pytest.raises(GrammarError, match="Unsupported type"):
        check(protocol.StructuredOutput("json_schema", json.dumps({"type": "objectx"})))
    with pytest.raises(GrammarError):
        check(protocol.StructuredOutput("regex", ""))
