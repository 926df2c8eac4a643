"""The bounds a request meets before it costs gateway CPU (``services.gateway.bounds``): messages,
prompt bytes, stop strings, schema and tool sizes, each a 400 naming its field, raised before the
chat template renders, the tokenizer runs or a grammar is built; and the whole preparation runs
off the event loop that answers /health and streams every other request."""

from __future__ import annotations

import json
import threading

import pytest

from services.gateway import prompt
from services.gateway.frontend import Frontend
from services.gateway.prompt import PromptBuilder
from services.gateway.responses import Rejected
from shared.engines import structured
from shared.settings import Settings
from tests.fakes import AnyKey

CONTEXT = 4096  # the tiny test model's
MODEL = "mmfleet-demo"
HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": HI, **fields}).encode()


def tool(name: str, params: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params or {"type": "object"}}}


def big_schema(size: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(size // 24)}}


CASES = {
    "messages beyond the context": (json.dumps({"model": MODEL, "messages": HI * (CONTEXT + 1)}), True,
                                    "messages"),
    "a completions prompt past its bytes": (json.dumps({"model": MODEL, "prompt": "x" * (32 * CONTEXT + 1)}),
                                            False, "prompt"),
    "a message's text past its bytes": (json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "é" * (16 * CONTEXT + 1)}]}]}), True, "messages"),
    "tool-call arguments past the prompt's bytes": (json.dumps({"model": MODEL, "messages": HI + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "a" * 32 * CONTEXT}}]}]}),
        True, "messages"),
    "a long stop string": (chat(stop=["s" * 1025]).decode(), True, "stop"),
    "a large schema": (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": big_schema(200_000)}}).decode(), True, "response_format.json_schema.schema"),
    "too many tools": (chat(tools=[tool(f"f{i}") for i in range(129)]).decode(), True, "tools"),
    "tools too large together": (chat(tools=[tool(f"f{i}", big_schema(4_000)) for i in range(100)]).decode(),
                                 True, "tools"),
    "one tool's parameters too large": (chat(tools=[tool("f", big_schema(200_000))]).decode(), True,
                                        "tools[0].function.parameters"),
}


@pytest.fixture(scope="module")
def builder(model_dir):
    return PromptBuilder.for_model(model_dir, Settings())


@pytest.fixture
def nothing_costly(monkeypatch):
    """Rendering, tokenizing and grammar building fail the test if reached."""
    def reached(*_args, **_kwargs):
        raise AssertionError("reached before the request's bounds were checked")

    monkeypatch.setattr(prompt, "render_chat", reached)
    monkeypatch.setattr(PromptBuilder, "_tokenize", reached)
    monkeypatch.setattr(structured, "check", reached)


@pytest.mark.parametrize("case", CASES)
def test_a_request_past_a_bound_is_a_400_naming_it_before_anything_costly(builder, nothing_costly, case):
    body, is_chat, param = CASES[case]
    front = Frontend(Settings(), builder, None, None, None, None, None)
    with pytest.raises(Rejected) as info:
        front.prepare(body.encode(), chat=is_chat)
    assert (info.value.event.status, info.value.event.param) == (400, param), info.value.event


def test_the_bounds_follow_their_settings(model_dir):
    s = Settings(max_request_messages=3, max_stop_string_bytes=8, max_tools=2, max_prompt_bytes=10)
    front = Frontend(s, PromptBuilder.for_model(model_dir, s), None, None, None, None, None)
    front.prepare(chat(stop=["12345678"], tools=[tool("a"), tool("b")]), chat=True)  # at each bound: served
    for body, param in ((json.dumps({"model": MODEL, "messages": HI * 4}).encode(), "messages"),
                        (chat(stop=["123456789"]), "stop"),
                        (chat(tools=[tool("a"), tool("b"), tool("c")]), "tools"),
                        (json.dumps({"model": MODEL, "prompt": "x" * 11}).encode(), "prompt")):
        with pytest.raises(Rejected) as info:
            front.prepare(body, chat=b'"prompt"' not in body)
        assert info.value.event.param == param


async def test_a_request_is_prepared_off_the_event_loop(builder, monkeypatch):
    front = Frontend(Settings(), builder, None, None, None, AnyKey(), None)
    threads = []

    def prepare(body, *, chat):
        threads.append(threading.current_thread())
        raise Rejected.of(400, "stop here")

    monkeypatch.setattr(front, "prepare", prepare)
    try:
        with pytest.raises(Rejected):
            async with front.admit(chat(), chat=True, authorization=None, via="http"):
                pass
    finally:
        front.close()
    assert threads and threads[0] is not threading.main_thread()
    assert front.inflight == 0
