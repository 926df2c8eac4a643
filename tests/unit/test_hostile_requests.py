"""Hostile request bodies against the gateway's one entry path (``Frontend.prepare``, shared by
HTTP and the Kafka ingress): each is refused with a 4xx naming what is wrong, never an exception
that would become a 500. The known cases first, then a property test over bodies built from the
request schema's own field names with arbitrary JSON values, nested deep and wide; last, a
request too large for one Kafka record is a 413 at once, not a queue outage after retries.
"""

from __future__ import annotations

import json

import pytest
from aiokafka.errors import MessageSizeTooLargeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway import schema
from services.gateway.frontend import Frontend
from services.gateway.prompt import PromptBuilder
from services.gateway.responses import Rejected
from shared.settings import Settings
from tests.fakes import AnyKey
from tests.media import samples

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def front(model_dir):
    s = Settings()
    return Frontend(s, PromptBuilder.for_model(model_dir, s), None, None, None, None, None)


def refusal(front, body: bytes, *, chat: bool = True):
    with pytest.raises(Rejected) as info:
        front.prepare(body, chat=chat)
    return info.value.event


def chat(**fields) -> bytes:
    return json.dumps({"model": "mmfleet-demo", "messages": MSGS, **fields}).encode()


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def image_chat(**fields) -> bytes:
    image = {"type": "image_url", "image_url": {"url": samples.data_url(samples.png((1, 1)))}}
    return json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user", "content": [
        image, {"type": "text", "text": "hi"}]}], **fields}).encode()


@pytest.mark.parametrize("name", ["min_pixels", "max_pixels"])
def test_pixels_beyond_the_image_token_bound_are_a_400_naming_them(model_dir, name):
    """min_pixels scales even a 1x1 PNG up to it: 40M pixels (within max_image_pixels) made a
    ~900 MiB tensor in media-fetch. The bound is max_image_tokens, or the model's context (the
    demo model's: 4096 tokens) when smaller, of 28x28 pixels each."""
    for max_tokens, limit in ((16_384, 4096 * 28 * 28), (64, 64 * 28 * 28)):
        s = Settings(max_image_tokens=max_tokens)
        front = Frontend(s, PromptBuilder.for_model(model_dir, s), None, None, None, None, None)
        for value in (40_000_000, limit + 1):
            ev = refusal(front, image_chat(mm_processor_kwargs={name: value}))
            assert (ev.status, ev.param) == (400, f"mm_processor_kwargs.{name}") and str(limit) in ev.message
        prepared, _ = front.prepare(image_chat(mm_processor_kwargs={name: limit}), chat=True)
        assert getattr(prepared.media[0], name) == limit


def test_max_completion_tokens_zero_is_refused_by_name(front):
    ev = refusal(front, chat(max_completion_tokens=0))
    assert (ev.status, ev.param) == (400, "max_completion_tokens")


@pytest.mark.parametrize("depth", [65, 5_000, 200_000])
@pytest.mark.parametrize("field", ["tools", "response_format", "chat_template_kwargs", "an_unknown_field"])
def test_deep_nesting_in_any_free_form_field_is_a_400(front, field, depth):
    body = chat()[:-1] + b', "' + field.encode() + b'": ' + nested(depth) + b"}"
    assert refusal(front, body).status == 400


def test_deep_nesting_in_tool_call_arguments_is_a_400(front):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                       "function": {"name": "f", "arguments": "x"}}]}]
    body = json.dumps({"model": "mmfleet-demo", "messages": messages}).encode()
    body = body.replace(b'"arguments": "x"', b'"arguments": ' + nested(3_000))
    assert refusal(front, body).status == 400


@pytest.mark.parametrize("key", ["\u00b2", "\u0661\u0662", "1e3", " 7", "-1"])
def test_a_logit_bias_key_that_is_not_an_ascii_token_id_is_a_400(front, key):
    ev = refusal(front, chat(logit_bias={key: 1}))
    assert (ev.status, ev.param) == (400, "logit_bias")


@pytest.mark.parametrize("name", ["self", "kwargs", "conversation", "tokenize", "messages"])
def test_chat_template_kwargs_naming_a_rendering_argument_is_a_400(front, name):
    ev = refusal(front, chat(chat_template_kwargs={name: 1}))
    assert (ev.status, ev.param) == (400, "chat_template_kwargs")


def test_a_depth_within_the_bound_still_passes(front):
    schema_ = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    front.prepare(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema_}}),
                  chat=True)
    assert not schema.too_deep([[[]]], limit=3) and schema.too_deep([[[[]]]], limit=3)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=40)
CHAT_FIELDS = sorted(schema._CHAT_FIELDS - {"model", "messages", "stream"})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"])},
                                optional={"content": JSON | st.text(max_size=30), "name": JSON,
                                          "tool_calls": JSON, "tool_call_id": JSON})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(CHAT_FIELDS), JSON, max_size=4),
       messages=st.lists(MESSAGE, min_size=0, max_size=3))
def test_no_body_built_from_the_schema_gets_anything_but_an_answer_or_a_4xx(front, fields, messages):
    body = json.dumps({"model": "mmfleet-demo", "messages": messages or MSGS, **fields}).encode()
    try:
        front.prepare(body, chat=True)
    except Rejected as rejected:
        assert 400 <= rejected.event.status < 500, rejected.event


class _RecordTooLarge:
    """A producer whose broker refuses every record as too large (what aiokafka raises for a
    record past ``max_request_size``)."""

    def __init__(self) -> None:
        self.tries = 0

    async def send(self, *args, **kwargs):
        self.tries += 1
        raise MessageSizeTooLargeError()

    async def send_and_wait(self, *args, **kwargs):
        self.tries += 1
        raise MessageSizeTooLargeError()


async def test_a_request_too_large_for_one_record_is_a_413_at_once_not_a_queue_outage(model_dir):
    s = Settings(queue_retry_ms=60_000)
    producer = _RecordTooLarge()
    front = Frontend(s, PromptBuilder.for_model(model_dir, s), producer, None, None, AnyKey(), None)
    with pytest.raises(Rejected) as info:
        async with front.admit(chat(stop=["x" * 100]), chat=True, authorization=None, via="http"):
            pass
    assert (info.value.event.status, info.value.event.code) == (413, "request_too_large")
    assert producer.tries == 2  # the send, and one wait on it: never retried until the deadline
    assert front.inflight == 0


class _OverItsRate(AnyKey):
    async def charge(self, key_id, *, via):
        raise Rejected.of(429, "over the rate", code="rate_limit_exceeded", retry_after_s=1)


class _NoKey(AnyKey):
    def identify(self, authorization, *, via):
        raise Rejected.of(401, "missing API key", code="missing_api_key")


@pytest.mark.parametrize(("auth", "status"), [(_NoKey(), 401), (_OverItsRate(), 429)])
async def test_a_bad_key_or_one_over_its_rate_is_refused_before_its_body_is_read(model_dir, auth, status):
    s = Settings()
    front = Frontend(s, PromptBuilder.for_model(model_dir, s), _RecordTooLarge(), None, None, auth, None)
    reads = []

    async def body() -> bytes:
        reads.append(1)
        return chat()

    with pytest.raises(Rejected) as info:
        async with front.admit(body, chat=True, authorization=None, via="http"):
            pass
    assert info.value.event.status == status and reads == []  # nothing read, nothing parsed
