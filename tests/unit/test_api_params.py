"""The gateway's field decisions without a fleet: ``Frontend.prepare`` (parse, unknown fields,
``params.check_fields``, prompt and sampling) on the same bodies the conformance test sends
through the openai client — every refused one is a 400 naming its field — plus the setting
that lets unknown fields through and the sampling controls' mapping into ``protocol.Sampling``."""

from __future__ import annotations

import json

import pytest

from services.gateway.frontend import Frontend
from services.gateway.prompt import PromptBuilder
from services.gateway.responses import Rejected
from shared import protocol
from shared.settings import Settings
from tests.e2e.test_api_conformance import CHAT_REFUSED, COMPLETION_REFUSED, MODEL, MSGS, PROMPT


def _front(model_dir, **settings) -> Frontend:
    s = Settings(**settings)
    return Frontend(s, PromptBuilder.for_model(model_dir, s), None, None, None, None, None)


@pytest.fixture(scope="module")
def front(model_dir):
    return _front(model_dir)


def _body(base: dict, kwargs: dict) -> bytes:
    """What the openai client sends for ``kwargs`` (``extra_body`` merged at the top level)."""
    extra = kwargs.get("extra_body", {})
    return json.dumps({"model": MODEL, "max_tokens": 4, **base,
                       **{k: v for k, v in kwargs.items() if k != "extra_body"}, **extra}).encode()


@pytest.mark.parametrize(("kwargs", "param"), CHAT_REFUSED, ids=[p for _, p in CHAT_REFUSED])
def test_chat_refusals_name_the_field(front, kwargs, param):
    with pytest.raises(Rejected) as info:
        front.prepare(_body({"messages": MSGS}, kwargs), chat=True)
    ev = info.value.event
    assert (ev.status, ev.type, ev.param) == (400, "invalid_request_error", param), ev


@pytest.mark.parametrize(("kwargs", "param"), COMPLETION_REFUSED, ids=[p for _, p in COMPLETION_REFUSED])
def test_completion_refusals_name_the_field(front, kwargs, param):
    with pytest.raises(Rejected) as info:
        front.prepare(_body({"prompt": PROMPT}, kwargs), chat=False)
    assert (info.value.event.status, info.value.event.param) == (400, param)


def test_unknown_fields_pass_when_the_setting_allows_them(model_dir):
    body = _body({"messages": MSGS}, {"extra_body": {"some_sdk_extra": {"x": 1}}})
    prepared, _ = _front(model_dir, allow_extra_request_fields=True).prepare(body, chat=True)
    assert prepared.prompt_token_ids


def test_sampling_controls_reach_the_wire(front):
    body = _body({"prompt": PROMPT}, {"temperature": 0.7, "seed": 9, "presence_penalty": 0.5,
                                      "frequency_penalty": -0.5, "logit_bias": {"7": -100, "3": 2.5},
                                      "extra_body": {"top_k": -1, "min_p": 0.1, "repetition_penalty": 1.1,
                                                     "min_tokens": 2, "ignore_eos": True,
                                                     "stop_token_ids": [9, 5, 9]}})
    prepared, _ = front.prepare(body, chat=False)
    assert prepared.sampling == protocol.Sampling(
        max_tokens=4, temperature=0.7, top_p=1.0, seed=9, top_k=0, min_p=0.1, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias=((3, 2.5), (7, -100.0)), min_tokens=2,
        ignore_eos=True, stop_token_ids=(5, 9))
    assert protocol.decoder_for(protocol.RequestMeta).decode(protocol.encode(protocol.RequestMeta(
        request_id="r", model=MODEL, deadline_unix_ms=1, created_unix_ms=0, prompt_token_ids=(1,),
        sampling=prepared.sampling))).sampling == prepared.sampling


def test_logprobs_shapes():
    from services.gateway.responses import Shaper

    lps = (protocol.TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5))), protocol.TokenLogprob(2, -2.0, ((1, -0.1),)))
    text = {1: "a", 2: "bé"}.__getitem__
    chat = Shaper("r", MODEL, chat=True, token_text=text).whole("abé", protocol.Finish(
        "stop", protocol.Usage(1, 2)), lps)["choices"][0]["logprobs"]
    assert chat["content"][1] == {"token": "bé", "logprob": -2.0, "bytes": list("bé".encode()),
                                  "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}
    cmpl = Shaper("r", MODEL, chat=False, token_text=text)
    first = cmpl.chunk_body("a", None, logprobs=lps[:1])["choices"][0]["logprobs"]
    second = cmpl.chunk_body("bé", None, logprobs=lps[1:])["choices"][0]["logprobs"]
    assert first == {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5, "bé": -1.5}],
                     "text_offset": [0]}
    assert second["text_offset"] == [1] and second["top_logprobs"] == [{"a": -0.1, "bé": -2.0}]
    assert Shaper("r", MODEL, chat=True).chunk_body("x", None)["choices"][0]["logprobs"] is None


async def test_stream_writer_records_the_logprobs_of_sampled_tokens(model_dir):
    from transformers import AutoTokenizer

    from shared.engines.base import SampledToken
    from shared.engines.token_stream import stream_completion
    from tests.fakes import ListSink

    lp = [protocol.TokenLogprob(t, -float(t), ((t, -float(t)),)) for t in (11, 12)]

    async def tokens():
        yield SampledToken(lp[1])

    events = ListSink()
    meta = protocol.RequestMeta(request_id="r", model=MODEL, deadline_unix_ms=1, created_unix_ms=0,
                                prompt_token_ids=(1,), sampling=protocol.Sampling(max_tokens=2, logprobs=1))
    await stream_completion(events, meta, tokens(), tokenizer=AutoTokenizer.from_pretrained(model_dir),
                            eos_token_ids=frozenset(), prompt_len=1, first_token=SampledToken(lp[0]))
    deltas = [e for e in await events.history("r") if isinstance(e, protocol.TokenDelta)]
    assert [d.logprobs for d in deltas if d.token_ids] == [(lp[0],), (lp[1],)]
    assert all(type(t) is int for d in deltas for t in d.token_ids)
    assert protocol.decode_event(protocol.encode(deltas[0])) == deltas[0]  # it crosses Redis as msgpack


def _image_body(extra: dict, detail: str | None = None, n: int = 1) -> bytes:
    from tests.media import samples

    url = {"url": samples.data_url(samples.png((64, 48))), **({"detail": detail} if detail else {})}
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": url} for _ in range(n)), {"type": "text", "text": "hi"}]}],
        **extra}).encode()


def test_pixel_budget_and_detail_reach_the_media_items(front):
    prepared, _ = front.prepare(_image_body({"mm_processor_kwargs": {"min_pixels": 3136, "max_pixels": 400_000}}),
                                chat=True)
    assert [(m.min_pixels, m.max_pixels) for m in prepared.media] == [(3136, 400_000)]
    low, _ = front.prepare(_image_body({}, detail="low"), chat=True)
    assert (low.media[0].min_pixels, low.media[0].max_pixels) == (0, 512 * 512)
    both, _ = front.prepare(_image_body({"mm_processor_kwargs": {"max_pixels": 100_000}}, detail="low"), chat=True)
    assert both.media[0].max_pixels == 100_000
    high, _ = front.prepare(_image_body({}, detail="high"), chat=True)
    assert (high.media[0].min_pixels, high.media[0].max_pixels) == (0, 0)


def test_per_modality_limit(model_dir):
    limited = _front(model_dir, max_images_per_request=2)
    limited.prepare(_image_body({}, n=2), chat=True)
    with pytest.raises(Rejected) as info:
        limited.prepare(_image_body({}, n=3), chat=True)
    ev = info.value.event
    assert (ev.status, ev.param, ev.code) == (400, "messages", "too_many_media_items") and "at most 2" in ev.message


def test_image_preprocessor_takes_the_budget(model_dir):
    from PIL import Image

    from shared.engines.qwen2_vl import ImagePreprocessor

    pre = ImagePreprocessor(model_dir)
    img = Image.new("RGB", (400, 300))
    full, small = pre(img), pre(img, max_pixels=112 * 112)
    assert small.n_tokens < full.n_tokens and small.grid_thw[1] * small.grid_thw[2] * 14 * 14 <= 112 * 112


def test_unknown_message_fields_are_refused_by_path(front, model_dir):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"},
                                                    {"role": "user", "content": "x", "cache_control": {}}]}).encode()
    with pytest.raises(Rejected) as info:
        front.prepare(body, chat=True)
    assert (info.value.event.status, info.value.event.param) == (400, "messages[1].cache_control")
    _front(model_dir, allow_extra_request_fields=True).prepare(body, chat=True)
