"""``/tokenize`` and ``/detokenize`` without a fleet (``services.gateway.tokenize``): the ids are
the generation routes' own (the same rendering and tokenizing), media count as media-fetch and
prefill expand them (checked against the model's own image processor on the decoded image), the
refusals name their field, the bounds hold, and ``Frontend.answer_here`` keeps the API-key rule,
the in-flight bound and the preparation pool. Plus ``/v1/completions``' prompt forms."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading

import numpy as np
import pytest
from PIL import Image

from services.gateway import schema
from services.gateway.auth import Authenticator, hash_key
from services.gateway.frontend import Frontend
from services.gateway.media_tokens import MediaTokens
from services.gateway.prompt import MediaInput, PromptBuilder
from services.gateway.responses import Rejected
from services.gateway.tokenize import Tokenization
from shared.keys import RedisKeys
from shared.media.images import decode_image
from shared.settings import Settings
from tests.e2e.test_skeleton import noise_image, png_data_url

MODEL = "mmfleet-demo"
HI = [{"role": "user", "content": "Tell me a story about the sea."}]


def tokenization(model_dir, **settings) -> Tokenization:
    s = Settings(**settings)
    return Tokenization(PromptBuilder.for_model(model_dir, s), s,
                        MediaTokens.for_model(model_dir, max_image_pixels=s.max_image_pixels))


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenization:
    return tokenization(model_dir)


@pytest.fixture(scope="module")
def builder(tok) -> PromptBuilder:
    return tok._builder


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def refusal(fn, raw: bytes):
    with pytest.raises(Rejected) as info:
        fn(raw)
    return info.value.event


def image_part(url: str, **image_url) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **image_url}}


def test_the_ids_are_the_generation_routes_own(tok, builder):
    text = "Once upon a time"
    completion = builder.completion(schema.parse_completion(body(model=MODEL, prompt=text))).prompt_token_ids
    out = tok.tokenize(body(model=MODEL, prompt=text, return_token_strs=True))
    assert out == {"count": len(completion), "max_model_len": builder.context_tokens, "tokens": completion,
                   "token_strs": builder.tokenizer.convert_ids_to_tokens(completion)}
    chat = builder.chat(schema.parse_chat(body(model=MODEL, messages=HI))).prompt_token_ids
    assert tok.tokenize(body(messages=HI)) == {"count": len(chat), "max_model_len": builder.context_tokens,
                                               "tokens": chat, "token_strs": None}  # model: optional, as vLLM


def test_generation_prompt_and_continuing_the_final_message(tok, builder):
    turns = [*HI, {"role": "assistant", "content": "Once upon"}]
    opened = tok.tokenize(body(messages=turns))["tokens"]
    closed = tok.tokenize(body(messages=turns, add_generation_prompt=False))["tokens"]
    continued = tok.tokenize(body(messages=turns, add_generation_prompt=False, continue_final_message=True))["tokens"]
    assert len(continued) < len(closed) < len(opened) and opened[:len(continued)] == continued
    assert builder.tokenizer.decode(continued).endswith("Once upon")
    ev = refusal(tok.tokenize, body(messages=turns, continue_final_message=True))  # add_generation_prompt: true
    assert (ev.status, ev.param) == (400, "continue_final_message")


def test_a_prompt_past_the_context_is_counted_not_refused(tok, builder):
    text = "sea " * (builder.context_tokens + 10)
    assert tok.tokenize(body(prompt=text))["count"] > builder.context_tokens
    with pytest.raises(Exception, match="context"):
        builder.completion(schema.parse_completion(body(model=MODEL, prompt=text)))


def runs_of(ids: list[int], marks: frozenset[int]) -> list[int]:
    """The lengths of the runs of placeholder tokens in ``ids`` (one run per media item)."""
    runs: list[int] = []
    prev = False
    for t in ids:
        if t in marks:
            runs[-1:] = [runs[-1] + 1] if prev else [*runs[-1:], 1]
        prev = t in marks
    return runs


@pytest.mark.parametrize(("size", "budget"), [((320, 240), {}), ((97, 600), {}),
                                              ((640, 480), {"max_pixels": 112 * 112}),
                                              ((64, 64), {"min_pixels": 200 * 200})])
def test_an_inline_image_counts_what_the_image_processor_makes_of_it(tok, builder, model_dir, size, budget):
    from shared.engines.qwen2_vl import ImagePreprocessor

    url = png_data_url(noise_image(1, size=size))
    messages = [{"role": "user", "content": [image_part(url), {"type": "text", "text": "hi"}]}]
    extra = {"mm_processor_kwargs": budget} if budget else {}
    out = tok.tokenize(body(messages=messages, **extra))
    prepared = builder.chat(schema.parse_chat(body(model=MODEL, messages=messages, **extra)))
    item = prepared.media[0]
    img = decode_image(item.data, max_pixels=10**8, param="x")
    want = ImagePreprocessor(model_dir)(img, item.min_pixels, item.max_pixels).n_tokens
    assert runs_of(out["tokens"], builder.placeholder_ids) == [want]
    # the rest is the chat prompt, one placeholder per item there
    assert out["count"] == len(prepared.prompt_token_ids) + want - 1


def test_detail_low_and_two_images(tok, builder):
    big = png_data_url(noise_image(2, size=(1024, 768)))
    one = tok.tokenize(body(messages=[{"role": "user", "content": [image_part(big)]}]))
    low = tok.tokenize(body(messages=[{"role": "user", "content": [image_part(big, detail="low")]}]))
    two = tok.tokenize(body(messages=[{"role": "user", "content": [image_part(big), {"type": "text", "text": "and"},
                                                                   image_part(big, detail="low")]}]))
    marks = builder.placeholder_ids
    assert runs_of(two["tokens"], marks) == runs_of(one["tokens"], marks) + runs_of(low["tokens"], marks)
    # (the tiny model's own budget is below low detail's 512x512: low makes more tokens here)
    assert runs_of(low["tokens"], marks) != runs_of(one["tokens"], marks)


def test_an_exif_turned_image_is_sized_as_media_fetch_turns_it(tok):
    img = noise_image(3, size=(300, 100))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90°: shown 100 wide, 300 high
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif)
    decoded = decode_image(buf.getvalue(), max_pixels=10**8, param="x")
    assert tok._media._size(MediaInput("image", "p", data=buf.getvalue())) == (decoded.height, decoded.width) \
        == (300, 100)


def test_image_embeds_count_their_rows(tok, builder):
    buf = io.BytesIO()
    np.save(buf, np.zeros((4, builder._embeds_hidden), np.float32))
    part = {"type": "image_embeds", "image_embeds": {"data": base64.b64encode(buf.getvalue()).decode(),
                                                       "grid_thw": [1, 4, 4]}}
    out = tok.tokenize(body(messages=[{"role": "user", "content": [part]}]))
    assert runs_of(out["tokens"], builder.placeholder_ids) == [4]


@pytest.mark.parametrize("part", [image_part("https://example.com/a.png"),
                                  {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}])
def test_media_whose_count_needs_fetching_are_refused_by_name(tok, part):
    ev = refusal(tok.tokenize, body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]))
    assert (ev.status, ev.param, ev.code) == (400, "messages[0].content[1]", "unsupported_parameter"), ev


def test_a_size_free_family_counts_images_by_url():
    from transformers import AutoConfig

    from shared.engines.llava import llava_image_tokens
    from shared.models.llava_tiny import ensure_tiny_llava
    from tests.conftest import CACHE_DIR

    llava = ensure_tiny_llava(CACHE_DIR / "models")
    tok = tokenization(llava)
    out = tok.tokenize(body(messages=[{"role": "user", "content": [
        image_part("https://example.com/a.png"), {"type": "text", "text": "and"},
        image_part(png_data_url(noise_image(4)))]}]))
    n = llava_image_tokens(AutoConfig.from_pretrained(llava))  # what its prefill expands each image to
    assert runs_of(out["tokens"], tok._builder.placeholder_ids) == [n, n]


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": HI, "max_tokens": 3}, "max_tokens"),  # a generation field: not a /tokenize one
    ({"prompt": "x", "messages_": 1}, "messages_"),
    ({"messages": [{"role": "user", "content": "x", "cache_control": {}}]}, "messages[0].cache_control"),
    ({"messages": [{"role": "function", "name": "f", "content": "1"}]}, "messages[0].role"),
    ({"prompt": ["a"]}, "prompt"),  # vLLM's /tokenize takes one text
    ({"model": "other", "prompt": "x"}, "model"),
    ({"prompt": "x" * (32 * 4096 + 1)}, "prompt"),
    ({"messages": [{"role": "user", "content": "x" * (32 * 4096 + 1)}]}, "messages"),
    ({"messages": HI, "chat_template": "{{ messages }}"}, "chat_template"),
])
def test_tokenize_refusals_name_the_field(tok, fields, param):
    ev = refusal(tok.tokenize, body(**fields))
    assert ev.param == param and ev.status in (400, 404), ev


def test_detokenize(tok, builder):
    ids = tok.tokenize(body(messages=HI))["tokens"]
    assert tok.detokenize(body(model=MODEL, tokens=ids)) == {"prompt": builder.tokenizer.decode(ids)}
    assert "<|im_start|>" in tok.detokenize(body(tokens=ids))["prompt"]  # special tokens kept, as vLLM
    assert tok.detokenize(body(tokens=[])) == {"prompt": ""}
    for fields, param in (({"tokens": [len(builder.tokenizer)]}, "tokens"), ({"tokens": [-1]}, "tokens"),
                          ({"tokens": [1] * 4097}, "tokens"), ({"tokens": [1], "skip": True}, "skip"),
                          ({"tokens": "1"}, "tokens"), ({"model": "other", "tokens": [1]}, "model")):
        assert refusal(tok.detokenize, body(**fields)).param == param, fields


def test_a_body_past_the_json_values_bound_costs_nothing(tok):
    ev = refusal(tok.tokenize, b'{"prompt": "x", "tokens": [' + b"1," * 80_000 + b"1]}")
    assert ev.code == "request_too_complex"
    assert refusal(tok.detokenize, b'{"tokens": [' + b"1," * 80_000 + b"1]}").code == "request_too_complex"


# ---------------------------------------------------------------------- Frontend.answer_here
async def test_answer_here_keeps_the_key_rule_the_bound_and_the_pool(model_dir):
    s = Settings(api_key_hashes=(hash_key("sk-t"),), max_inflight_requests=1)
    front = Frontend(s, PromptBuilder.for_model(model_dir, s), None, None, None,
                     Authenticator(s, None, RedisKeys("t")), None)
    read = []

    async def raw() -> bytes:
        read.append(1)
        return b"{}"

    def answer(b: bytes) -> dict:
        return {"thread": threading.current_thread().name, "body": b.decode()}

    try:
        with pytest.raises(Rejected) as info:
            await front.answer_here(raw, answer, authorization="Bearer wrong", via="http")
        assert info.value.event.status == 401 and not read  # the body is never read without the key
        out = await front.answer_here(raw, answer, authorization="Bearer sk-t", via="http")
        assert out["thread"].startswith("gateway-prepare") and out["body"] == "{}"
        release = threading.Event()

        def slow(b: bytes) -> dict:
            release.wait(10)
            return {}

        first = asyncio.ensure_future(front.answer_here(raw, slow, authorization="Bearer sk-t", via="http"))
        await asyncio.sleep(0.05)
        with pytest.raises(Rejected) as info:
            await front.answer_here(raw, answer, authorization="Bearer sk-t", via="http")
        assert (info.value.event.status, info.value.event.code) == (429, "overloaded")
        release.set()
        assert await first == {}
    finally:
        front.close()


# ---------------------------------------------------------------------- /v1/completions prompt forms
@pytest.fixture(scope="module")
def front(model_dir):
    s = Settings()
    yield Frontend(s, PromptBuilder.for_model(model_dir, s), None, None, None, None, None)


def prompt_ids(front, prompt) -> list[int]:
    return front.prepare(body(model=MODEL, prompt=prompt, max_tokens=2), chat=False)[0].prompt_token_ids


def test_one_prompt_in_any_form_is_served(front, builder):
    ids = prompt_ids(front, "Once upon a time")
    assert prompt_ids(front, ["Once upon a time"]) == ids
    assert prompt_ids(front, ids) == ids and prompt_ids(front, [ids]) == ids


def test_token_ids_are_taken_as_given(model_dir):
    """Even where the tokenizer adds a BOS to a text, as vLLM takes token-id prompts."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(model_dir)
    t.add_special_tokens({"bos_token": "<s>"})
    bos = t.convert_tokens_to_ids("<s>")
    t.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    b = PromptBuilder(t, max_model_len=4096, settings=Settings(), chat_template=t.chat_template)
    assert b.completion_prompt("hello", None)[0] == bos
    assert b.completion_prompt([7, 8, 9], None) == [7, 8, 9]


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]], [], [[]], [1, "a"], ["a", [1]], [10**7], [1] * 4096])
def test_several_prompts_and_bad_ids_are_a_400_naming_prompt(front, prompt):
    with pytest.raises(Rejected) as info:
        prompt_ids(front, prompt)
    assert (info.value.event.status, info.value.event.param) == (400, "prompt"), info.value.event
    if prompt in (["a", "b"], [[1, 2], [3]]):
        assert "send them as separate requests" in info.value.event.message
