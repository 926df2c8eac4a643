"""Tool calling in the gateway (services.gateway.tools): plans for each tool_choice, the
Hermes-format rendering of tools and tool messages for a template that has none, parsing of
forced and auto completions, and the streaming hold-back that never shows a call as content."""

from __future__ import annotations

import json

import pytest

from services.gateway import schema, tools
from shared.stage import RequestFailed
from tests.e2e.test_api_conformance import HISTORY, TOOLS


def test_plans():
    assert tools.plan(None, None).mode == "" and tools.plan(TOOLS, "none").mode == ""
    assert tools.plan(TOOLS, None).mode == tools.plan(TOOLS, "auto").mode == "auto"
    forced = tools.plan(TOOLS, {"type": "function", "function": {"name": "add"}})
    anyof = json.loads(forced.structured.schema)["anyOf"]
    assert forced.mode == "forced" and [a["properties"]["name"]["const"] for a in anyof] == ["add"]
    assert len(json.loads(tools.plan(TOOLS, "required").structured.schema)["anyOf"]) == 2
    for bad_tools, choice, param in ((None, "required", "tool_choice"), ([{"type": "x"}], None, "tools[0]"),
                                     (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                     (TOOLS, "sometimes", "tool_choice")):
        with pytest.raises(RequestFailed) as info:
            tools.plan(bad_tools, choice)
        assert info.value.event.param == param


def test_render_without_native_tool_support():
    msgs = schema.parse_chat(json.dumps({"model": "m", "messages": HISTORY}).encode()).messages
    rendered = [{"role": m.role, "content": m.content or ""} for m in msgs]
    out = tools.render_messages(rendered, msgs, tools.plan(TOOLS, "auto"), native=False)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
                                                      '\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    native = tools.render_messages(rendered, msgs, tools.plan(TOOLS, "auto"), native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert native[2]["tool_call_id"] == "call_1" and len(native) == 3


def test_parse_forced_and_auto():
    content, calls = tools.parse('{"name": "add", "arguments": {"a": 1, "b": 2}}', "forced")
    assert content is None and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert tools.parse('{"name": "add", "argu', "forced") == ('{"name": "add", "argu', [])  # cut by max_tokens
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tools.parse(text, "auto")
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert tools.parse("no calls here", "auto") == ("no calls here", [])


def test_stream_holds_back_what_may_be_a_call():
    s = tools.ToolStream("auto")
    shown = [s.feed(t) for t in ("Hi <", "tool", "_call>\n{\"name\": \"add\", ", "\"arguments\": {}}\n</tool_call>")]
    assert "".join(shown) == "Hi " and s.finish()[1][0]["function"]["name"] == "add"
    plain = tools.ToolStream("auto")
    assert [plain.feed(t) for t in ("a <", "b")] == ["a ", "<b"] and plain.finish() == ("", [])
    forced = tools.ToolStream("forced")
    assert forced.feed('{"name": "add", "arguments": {}}') == "" and forced.finish()[1]
