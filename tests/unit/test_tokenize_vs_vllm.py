"""The gateway's ``/tokenize`` and ``/detokenize`` answers equal vLLM's own for the same model and
body: vLLM's serving code for the two routes (``ServingTokenization`` over its renderer, as its
GPU-less render server builds them) runs in-process, without an engine, beside
``services.gateway.tokenize``; no server is started. Text and chat forms, the generation prompt,
a continued final message, special tokens, token strings, and inline images (vLLM fetches and
processes each; the gateway counts from the header) for Qwen2-VL, LLaVA and LLaVA-NeXT."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.media_tokens import MediaTokens
from services.gateway.prompt import PromptBuilder
from services.gateway.tokenize import Tokenization
from shared.settings import Settings
from tests.conftest import CACHE_DIR
from tests.e2e.test_skeleton import noise_image, png_data_url

pytest.importorskip("vllm")

MODEL = Settings().served_model_name
HI = [{"role": "user", "content": "Tell me a story about the sea."}]
TEXT_CASES = [
    {"prompt": "Once upon a time", "return_token_strs": True},
    {"prompt": "Once upon a time", "add_special_tokens": False},
    {"prompt": "héllo wörld 🌊\n\ttabs  and   spaces"},
    {"messages": HI},
    {"messages": [{"role": "system", "content": "Be brief."}, *HI, {"role": "assistant", "content": "Once"},
                  {"role": "user", "content": "More."}], "return_token_strs": True},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]},
    {"messages": HI, "add_generation_prompt": False},
    {"messages": [*HI, {"role": "assistant", "content": "Once upon"}], "add_generation_prompt": False,
     "continue_final_message": True},
    {"messages": HI, "add_special_tokens": True},
]


def image_cases() -> list[dict]:
    def part(size):
        return {"type": "image_url", "image_url": {"url": png_data_url(noise_image(sum(size), size=size))}}

    text = {"type": "text", "text": "What is in it?"}
    return [{"messages": [{"role": "user", "content": [part((320, 240)), text]}]},
            {"messages": [{"role": "user", "content": [part((97, 600)), text, part((640, 480))]}]}]


def vllm_tokenization(model_dir, max_model_len: int):
    """vLLM's own /tokenize and /detokenize handler for ``model_dir``, no engine behind it."""
    from vllm import AsyncEngineArgs, envs
    from vllm.config import VllmConfig
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.renderers import renderer_from_config
    from vllm.renderers.online_renderer import OnlineRenderer

    config = AsyncEngineArgs(model=str(model_dir), served_model_name=[MODEL], dtype="float32",
                             max_model_len=max_model_len).create_model_config()
    envs.VLLM_CPU_KVCACHE_SPACE = 0  # as vLLM's render server: no KV cache is ever allocated
    renderer = renderer_from_config(VllmConfig(model_config=config))
    online = OnlineRenderer(model_config=config, renderer=renderer, request_logger=None, chat_template=None,
                            chat_template_content_format="auto", trust_request_chat_template=False,
                            trust_request_mm_kwargs=True, enable_auto_tools=False,
                            exclude_tools_when_tool_choice_none=False, tool_parser=None, tool_strict_level=None,
                            reasoning_parser=None, default_chat_template_kwargs=None, log_error_stack=False)
    models = OpenAIModelRegistry(config, [BaseModelPath(name=MODEL, model_path=str(model_dir))])
    return ServingTokenization(models, online, chat_template=None, chat_template_content_format="auto")


def vllm_answer(serving, route: str, fields: dict) -> dict:
    from vllm.entrypoints.serve.tokenize.protocol import (
        DetokenizeRequest,
        TokenizeChatRequest,
        TokenizeCompletionRequest,
    )

    kind = DetokenizeRequest if route == "detokenize" else \
        TokenizeChatRequest if "messages" in fields else TokenizeCompletionRequest
    handler = serving.create_detokenize if route == "detokenize" else serving.create_tokenize
    return asyncio.run(handler(kind(model=MODEL, **fields), None)).model_dump()


def ours(model_dir) -> Tokenization:
    s = Settings()
    return Tokenization(PromptBuilder.for_model(model_dir, s), s,
                        MediaTokens.for_model(model_dir, max_image_pixels=s.max_image_pixels))


def _family(name: str):
    from shared.models.llava_next_tiny import ensure_tiny_llava_next
    from shared.models.llava_tiny import ensure_tiny_llava

    return {"llava": ensure_tiny_llava, "llava_next": ensure_tiny_llava_next}[name](CACHE_DIR / "models")


@pytest.fixture(scope="module", params=["qwen2_vl", "llava", "llava_next"])
def pair(request, model_dir):
    path = model_dir if request.param == "qwen2_vl" else _family(request.param)
    mine = ours(path)
    return request.param, mine, vllm_tokenization(path, mine._builder.context_tokens)


def test_tokenize_and_detokenize_equal_vllms(pair):
    family, mine, theirs = pair
    cases = TEXT_CASES + image_cases()
    if family == "qwen2_vl":  # the per-request pixel budget this family takes
        cases.append({**image_cases()[0], "mm_processor_kwargs": {"max_pixels": 112 * 112}})
    for fields in cases:
        got = mine.tokenize(json.dumps({"model": MODEL, **fields}).encode())
        want = vllm_answer(theirs, "tokenize", fields)
        assert got == want, (family, fields)
        back = mine.detokenize(json.dumps({"model": MODEL, "tokens": got["tokens"]}).encode())
        assert back == vllm_answer(theirs, "detokenize", {"tokens": got["tokens"]}), (family, fields)
