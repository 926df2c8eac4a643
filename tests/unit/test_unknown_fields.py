"""No field is dropped unseen at any depth: a key the schema does not declare, in the body, a
message, a content part or an object inside one (``image_url``, ``video_url``, ...), or
``stream_options``, is a 400 naming its path (unless ``allow_extra_request_fields``). Also the
two fields that were read but had no effect: a message's ``name`` reaches the chat template, and
``parallel_tool_calls: false`` keeps the first tool call alone."""

from __future__ import annotations

import copy
import json

import pytest

from services.gateway import schema, tools
from services.gateway.frontend import Frontend
from services.gateway.prompt import PromptBuilder
from services.gateway.responses import Rejected
from shared.settings import Settings

PNG = "data:image/png;base64,AAAA"  # never decoded: only the keys are read
# every object the schema types, once: the paths an unknown key is tried at
FULL = {"model": "mmfleet-demo", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": PNG, "detail": "auto"}},
            {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4", "num_frames": 4}},
            {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "image_embeds", "image_embeds": {"data": "AAAA", "format": "npy", "grid_thw": [1, 2, 2]}}]}]}


def _objects(value, path=""):
    """(path, the object) for every JSON object in ``value``."""
    if isinstance(value, dict):
        yield path, value
        for k, v in value.items():
            yield from _objects(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _objects(v, f"{path}[{i}]")


PATHS = [p for p, _ in _objects(FULL)]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p or "(top)")
def test_an_unknown_key_at_any_depth_is_named(path):
    body = copy.deepcopy(FULL)
    target = dict(_objects(body))[path]
    target["not_a_field"] = 1
    sent = schema.as_sent(json.dumps(body).encode(), chat=True)
    assert schema.unknown_fields(sent, chat=True) == [f"{path}.not_a_field" if path else "not_a_field"]


def test_the_full_body_has_none():
    assert schema.unknown_fields(schema.as_sent(json.dumps(FULL).encode(), chat=True), chat=True) == []
    assert len(PATHS) >= 10  # the walk reached every nested object


@pytest.fixture(scope="module")
def front(model_dir):
    s = Settings()
    return Frontend(s, PromptBuilder.for_model(model_dir, s), None, None, None, None, None)


def test_a_misspelt_video_option_is_a_400_naming_it(front):
    body = {"model": "mmfleet-demo", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4", "num_frame": 4}}]}]}
    with pytest.raises(Rejected) as info:
        front.prepare(json.dumps(body).encode(), chat=True)
    assert (info.value.event.status, info.value.event.param) == (400, "messages[0].content[0].video_url.num_frame")


def test_a_messages_name_reaches_the_template(model_dir):
    s = Settings()
    builder = PromptBuilder.for_model(model_dir, s)
    named = PromptBuilder(builder._tok, max_model_len=4096, settings=s,
                          chat_template="{% for m in messages %}[{{ m.name or '-' }}] {{ m.content }}\n{% endfor %}")
    req = schema.parse_chat(json.dumps({"model": "mmfleet-demo", "messages": [
        {"role": "user", "name": "alice", "content": "hi"}, {"role": "user", "content": "there"}]}).encode())
    text = builder._tok.decode(named.chat(req).prompt_token_ids)
    assert "[alice] hi" in text and "[-] there" in text


CALLS = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
         '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')


def test_parallel_tool_calls_false_keeps_the_first_call():
    assert [c["function"]["name"] for c in tools.parse(CALLS, "auto")[1]] == ["a", "b"]
    assert [c["function"]["name"] for c in tools.parse(CALLS, "auto", max_calls=1)[1]] == ["a"]
    stream = tools.ToolStream("auto", max_calls=1)
    assert stream.feed(CALLS) == ""
    assert [c["function"]["name"] for c in stream.finish()[1]] == ["a"]


def test_parallel_tool_calls_false_reaches_the_answer(model_dir):
    s = Settings()
    builder = PromptBuilder.for_model(model_dir, s)
    req = lambda **f: schema.parse_chat(json.dumps({"model": "mmfleet-demo", "messages": [  # noqa: E731
        {"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a"}}], **f}).encode())
    assert builder.chat(req()).tool_max_calls == 0
    assert builder.chat(req(parallel_tool_calls=False)).tool_max_calls == 1
