"""Tool calling: ``tools`` / ``tool_choice`` in, OpenAI ``tool_calls`` out, in the Hermes / Qwen2.5
format: the model writes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

- :func:`plan` validates ``tools`` and ``tool_choice`` (400 naming the field) and picks the mode:
  "" (no tools), "auto" (the text is parsed for calls) or "forced" (``required`` or a named
  function: one call's JSON under a JSON-Schema grammar, valid even from the random demo model).
- :func:`render_messages`: tools go to a template that knows them; otherwise they are described
  in the system message and past calls rendered as the format's text. :func:`parse`: text →
  (content, calls). Design: docs/guide/api.md.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from shared import protocol
from shared.stage import RequestFailed

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class ToolPlan:
    mode: str = ""  # "" | "auto" | "forced"
    tools: tuple[dict, ...] = ()  # the OpenAI function objects ({"name", "description", "parameters"})
    structured: protocol.StructuredOutput | None = None  # the forced call's grammar


def _bad(param: str, message: str) -> RequestFailed:
    return RequestFailed.bad_request(f"{param}: {message}", param=param)


def plan(tools, tool_choice) -> ToolPlan:
    if tools in (None, []):
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs tools")
        return ToolPlan()
    if not isinstance(tools, list):  # its count and size: bounds.check_bounds
        raise _bad("tools", "must be a list of tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        functions.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": params})
    names = [f["name"] for f in functions]
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", tuple(functions))
    if tool_choice == "none":
        return ToolPlan("", tuple(functions))
    if tool_choice == "required":
        allowed = functions
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and tool_choice["function"].get("name") in names:
        allowed = [f for f in functions if f["name"] == tool_choice["function"]["name"]]
    else:
        raise _bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": "
                                  "{\"name\": <one of tools>}}")
    schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}}
                        for f in allowed]}
    spec = protocol.StructuredOutput("json_schema", json.dumps(schema))
    from shared.engines.structured import GrammarError, check

    try:
        check(spec)
    except GrammarError as exc:
        raise _bad("tools", f"a function's parameters are not a usable JSON Schema: {exc}") from None
    return ToolPlan("forced", tuple(functions), spec)


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_messages(rendered: list[dict], messages, tool_plan: ToolPlan, *, native: bool) -> list[dict]:
    """``rendered``: role/content dicts of ``messages`` (schema.Message) in order; returns what
    goes to ``apply_chat_template`` (see the module docstring)."""
    out = []
    for r, msg in zip(rendered, messages, strict=True):
        calls = msg.tool_calls or []
        if native:
            item = dict(r)
            if calls:
                item["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args(c)}} for c in calls]
            if msg.role == "tool":
                item["tool_call_id"] = msg.tool_call_id
            out.append(item)
        elif msg.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{_text(r['content'])}\n</tool_response>"})
        elif calls:
            text = "".join(f"\n<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _args(c)})}"
                           "\n</tool_call>" for c in calls)
            out.append({"role": "assistant", "content": (_text(r["content"]) + text).strip()})
        else:
            out.append(r)
    if tool_plan.tools and not native:
        described = "\n".join(json.dumps({"type": "function", "function": f}) for f in tool_plan.tools)
        system = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                  f"provided with function signatures within <tools></tools> XML tags:\n<tools>\n{described}\n"
                  "</tools>\n\nFor each function call, return a json object with function name and arguments "
                  "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                  "\"arguments\": <args-json-object>}\n</tool_call>")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": _text(out[0]["content"]) + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def check_message(i: int, msg) -> None:
    """A tool or assistant message's tool fields, checked (400 naming them)."""
    if msg.role == "tool" and not msg.tool_call_id:
        raise _bad(f"messages[{i}].tool_call_id", "tool messages need the tool_call_id they answer")
    if msg.tool_calls is not None:
        if msg.role != "assistant" or not isinstance(msg.tool_calls, list):
            raise _bad(f"messages[{i}].tool_calls", "only assistant messages carry a list of tool_calls")
        for j, c in enumerate(msg.tool_calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"messages[{i}].tool_calls[{j}]", "must be {\"id\", \"type\": \"function\", "
                                                            "\"function\": {\"name\", \"arguments\"}}")


def _args(call: dict):
    args = call["function"].get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args or "{}")
        except ValueError:
            return args
    return args


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def parse(text: str, mode: str, max_calls: int = 0) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of a finished completion. Forced: the text is one call's JSON;
    auto: every well-formed ``<tool_call>`` block is a call (the first ``max_calls`` of them when
    set) and the text before the first is the content (a block that is not JSON stays text)."""
    if mode == "forced":
        try:
            obj = json.loads(text)
        except ValueError:
            return text, []  # cut by max_tokens: no parseable call
        return None, [_call(obj)] if _is_call(obj) else []
    calls, first = [], None
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if _is_call(obj):
            calls.append(_call(obj))
            first = m.start() if first is None else first
    if not calls:
        return text, []
    return (text[:first].strip() or None), calls[:max_calls] if max_calls else calls


def _is_call(obj) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str)


def _call(obj: dict) -> dict:
    args = obj.get("arguments", {})
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


class ToolStream:
    """The streaming side of :func:`parse`: :meth:`feed` returns the text that can go to the
    client as content now (auto: everything before a possible ``<tool_call>``; forced: nothing);
    :meth:`finish` returns the rest as (content, calls) once the completion has ended."""

    def __init__(self, mode: str, max_calls: int = 0) -> None:
        self.mode = mode
        self.max_calls = max_calls
        self._held = ""
        self._in_call = mode == "forced"

    def feed(self, text: str) -> str:
        buf = self._held + text
        if self._in_call:
            self._held = buf
            return ""
        i = buf.find(OPEN_TAG)
        if i >= 0:
            self._in_call, self._held = True, buf[i:]
            return buf[:i]
        keep = next((n for n in range(min(len(buf), len(OPEN_TAG) - 1), 0, -1) if OPEN_TAG.startswith(buf[-n:])), 0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = parse(self._held, self.mode, self.max_calls)
        return ((content or "") if calls else self._held), calls
