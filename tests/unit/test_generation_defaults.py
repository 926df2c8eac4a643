"""A request that leaves sampling fields or ``max_tokens`` out gets what ``vllm serve`` gives it:
the model's generation-config defaults (the fields vLLM takes, read back from vLLM's own
``ModelConfig``), a budget to the end of the context (lowered by prefill to what the media
tokens leave), and prompts tokenized as vLLM's two endpoints do (BOS on completions only)."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers.processors import TemplateProcessing

from services.gateway import defaults, schema
from services.gateway.prompt import PromptBuilder
from services.prefill.handler import fit_context
from shared import protocol
from shared.settings import Settings
from shared.stage import RequestFailed

MODEL = "mmfleet-demo"
GENERATION = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 300,
              "do_sample": True}


@pytest.fixture(scope="module")
def tuned_dir(model_dir, tmp_path_factory):
    """The tiny model with a generation config that sets sampling defaults, as real checkpoints do."""
    d = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(model_dir, d)
    config = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**config, **GENERATION}))
    return d


def chat(**fields):
    return schema.parse_chat(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                         **fields}).encode())


def completion(prompt: str = "hello", **fields):
    return schema.parse_completion(json.dumps({"model": MODEL, "prompt": prompt, **fields}).encode())


def test_the_defaults_are_the_fields_vllm_takes_from_the_generation_config(tuned_dir):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    theirs = ModelConfig(model=str(tuned_dir), tokenizer=str(tuned_dir)).get_diff_sampling_param()
    ours = defaults.load(tuned_dir, "auto")
    assert {f: getattr(ours, f) for f in ours.__struct_fields__ if getattr(ours, f) is not None} == theirs
    assert theirs  # the config does set some


def test_a_request_without_sampling_fields_takes_the_models_defaults(tuned_dir):
    builder = PromptBuilder.for_model(tuned_dir, Settings())
    s = builder.chat(chat()).sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_tokens) == (0.7, 0.8, 20, 1.05, 300)
    s = builder.chat(chat(temperature=0, top_p=1.0, top_k=-1, max_tokens=5)).sampling  # the request's own win
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_tokens) == (0.0, 1.0, 0, 1.05, 5)
    neutral = PromptBuilder.for_model(tuned_dir, Settings(generation_config="vllm")).chat(chat()).sampling
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_without_max_tokens_a_request_may_write_to_the_end_of_its_context(model_dir):
    builder = PromptBuilder.for_model(model_dir, Settings())
    prepared = builder.completion(completion())
    assert prepared.sampling.max_tokens == builder.context_tokens - len(prepared.prompt_token_ids)
    capped = PromptBuilder.for_model(model_dir, Settings(default_max_tokens=64)).completion(completion())
    assert capped.sampling.max_tokens == 64
    with pytest.raises(RequestFailed) as info:  # past the whole context: refused, as vLLM does
        builder.completion(completion(max_tokens=builder.context_tokens + 1))
    assert info.value.event.param == "max_tokens"


def test_prefill_lowers_a_budget_to_the_context_its_media_leave():
    meta = protocol.RequestMeta(request_id="r", model=MODEL, created_unix_ms=0, deadline_unix_ms=1,
                                prompt_token_ids=tuple(range(10)), sampling=protocol.Sampling(max_tokens=95))
    item = protocol.EmbeddingItem(index=0, mm_hash="h", grid_thw=(1, 2, 2), n_tokens=11,
                                  embeds=protocol.empty_tensor_ref("x"))
    msg = protocol.PrefillRequest(meta=meta, items=(item,))
    total, fitted = fit_context(msg, max_model_len=100)
    assert (total, fitted.meta.sampling.max_tokens) == (20, 80)  # 10 ids, one placeholder → 11 tokens
    assert fit_context(msg, max_model_len=200)[1] is msg  # room enough: unchanged
    with pytest.raises(RequestFailed):
        fit_context(msg, max_model_len=20)  # no room left for one token


@pytest.fixture(scope="module")
def bos_builder(model_dir):
    """The tiny model's tokenizer made to add a BOS, as Llama's does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.convert_tokens_to_ids("<s>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return PromptBuilder(tok, max_model_len=4096, settings=Settings(), chat_template=tok.chat_template), bos


def test_completions_add_the_tokenizers_special_tokens_and_chat_does_not(bos_builder):
    builder, bos = bos_builder
    assert builder.completion(completion("hello")).prompt_token_ids[0] == bos
    assert builder.completion(completion("hello", add_special_tokens=False)).prompt_token_ids[0] != bos
    assert builder.chat(chat()).prompt_token_ids[0] != bos
    assert builder.chat(chat(add_special_tokens=True)).prompt_token_ids[0] == bos
    with pytest.raises(RequestFailed) as info:
        builder.completion(completion("hello", add_special_tokens="yes"))
    assert info.value.event.param == "add_special_tokens"
