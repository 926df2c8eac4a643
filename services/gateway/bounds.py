"""The bounds a request meets before it costs the gateway CPU or memory, each checked before the
work it bounds: the JSON values its body makes the decoder build, its free-form fields' sizes as
sent, then (decoded) its messages, prompt bytes, stop strings and tools before anything renders,
tokenizes or builds a grammar. Every refusal is a ``RequestFailed`` 400 naming the field.
Design: docs/guide/security.md.
"""

from __future__ import annotations

import msgspec

from services.gateway import prompt_forms, schema
from services.gateway.schema import TextPart
from shared.settings import Settings
from shared.stage import RequestFailed

PROMPT_BYTES_PER_TOKEN = 32  # max_prompt_bytes 0: this many bytes per token of context (BPE text averages ~4)


def decode_bounded(body: bytes, settings: Settings, *, chat: bool, context_tokens: int, decode=None):
    """``(request, schema.as_sent(body))``, each bound checked before what it bounds costs: the
    JSON values the decoder will build (one pass over the bytes), the free-form fields' sizes as
    sent, then (decoded) what rendering, tokenizing and grammars would be fed. ``decode``: the
    body's decoder where it is not the chat / completions request (/tokenize). Raises
    ``RequestFailed`` and msgspec's errors."""
    check_json_values(body, settings, context_tokens)
    sent = schema.as_sent(body, chat=chat)
    check_sizes_as_sent(sent, settings, chat=chat, context_tokens=context_tokens)
    req = (decode or (schema.parse_chat if chat else schema.parse_completion))(body)
    check_bounds(req, settings, context_tokens=context_tokens, chat=chat)
    return req, sent


def check_json_values(body: bytes, settings: Settings, context_tokens: int) -> None:
    """The JSON values a body may make its decoder build (one pass over its bytes)."""
    values, limit = schema.json_values_at_most(body), json_values_limit(settings, context_tokens)
    if values > limit:
        raise RequestFailed(400, f"the request body holds up to {values} JSON values (by its commas); this "
                                 f"server decodes at most {limit}", code="request_too_complex")


def check_bounds(req, settings: Settings, *, context_tokens: int, chat: bool) -> None:
    """The bounds on what a request brings before anything renders, tokenizes or builds a grammar
    from it (400 naming the field): messages, prompt text bytes, stop strings, schema and tools
    sizes. Each costs a pass over what the body already holds, no more."""
    s = settings
    if chat:
        limit = s.max_request_messages or context_tokens
        if len(req.messages) > limit:
            raise RequestFailed.bad_request(f"messages: {len(req.messages)} messages; this server takes at most "
                                            f"{limit}", param="messages")
    limit = prompt_bytes_limit(s, context_tokens)
    size = prompt_bytes(req, chat=chat)
    if size > limit:
        param = "messages" if chat else "prompt"
        raise RequestFailed.bad_request(f"{param}: the prompt's text is {size} bytes; this server takes at most "
                                        f"{limit} (the model's context is {context_tokens} tokens)", param=param,
                                        code="context_length_exceeded")
    stops = getattr(req, "stop", None)  # (a /tokenize request has none)
    for stop in (stops,) if isinstance(stops, str) else stops or ():
        if len(stop.encode()) > s.max_stop_string_bytes:
            raise RequestFailed.bad_request(f"stop: a stop string is longer than {s.max_stop_string_bytes} bytes",
                                            param="stop")
    if chat and isinstance(req.tools, list):
        _check_tools(req.tools, s)


def check_sizes_as_sent(sent, settings: Settings, *, chat: bool, context_tokens: int) -> None:
    """Free-form fields (arbitrary JSON: decoding them, and a schema's grammar, cost in proportion
    to their size) bounded by the JSON text they were sent as, before any is decoded. ``sent``:
    ``schema.as_sent`` of the body. ``response_format`` and every other free-form field by
    ``max_schema_bytes``, ``tools`` by ``max_tools_bytes``; template variables and the messages'
    tool calls go into the prompt, so by its limit."""
    s = settings
    prompt_limit = prompt_bytes_limit(s, context_tokens)
    limits = {"tools": s.max_tools_bytes, "chat_template_kwargs": prompt_limit}
    for name in schema.free_form_fields(chat=chat):
        raw = sent.top.get(name)
        limit = limits.get(name, s.max_schema_bytes)
        if raw is not None and len(raw) > limit:
            param = "response_format.json_schema.schema" if name == "response_format" else name
            raise RequestFailed.bad_request(f"{param}: {name} is {len(raw)} bytes as sent; this server takes at "
                                            f"most {limit}", param=param)
    calls = sum(len(raw) for m in sent.messages for name in schema.MESSAGE_FREE_FORM if (raw := m.get(name)))
    if calls > prompt_limit:
        raise RequestFailed.bad_request(f"messages: their tool calls are {calls} bytes as sent; the prompt takes at "
                                        f"most {prompt_limit}", param="messages", code="context_length_exceeded")


def _check_tools(tools: list, s: Settings) -> None:
    if len(tools) > s.max_tools:
        raise RequestFailed.bad_request(f"tools: {len(tools)} tools; this server takes at most {s.max_tools}",
                                        param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and _json_bytes(fn.get("parameters")) > s.max_schema_bytes:
            raise RequestFailed.bad_request(f"tools[{i}].function.parameters: larger than {s.max_schema_bytes} "
                                            "bytes as JSON", param=f"tools[{i}].function.parameters")


def json_values_limit(settings: Settings, context_tokens: int) -> int:
    """``max_request_json_values``, or (0) the context's tokens (a text's commas are rarely more
    than its tokens) and 64 Ki more for the request's structure."""
    return settings.max_request_json_values or context_tokens + 65_536


def prompt_bytes_limit(settings: Settings, context_tokens: int) -> int:
    return settings.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * context_tokens


def prompt_bytes(req, *, chat: bool) -> int:
    """UTF-8 bytes of the text a request brings to its prompt: a completions prompt; a chat's
    message contents, names, tool calls and ids, and its template variables (media excluded:
    they have their own byte bounds)."""
    if not chat:
        return prompt_forms.text_bytes(req.prompt)
    total = _json_bytes(req.chat_template_kwargs) if req.chat_template_kwargs else 0
    for msg in req.messages:
        if isinstance(msg.content, str):
            total += len(msg.content.encode())
        elif msg.content:
            total += sum(len(part.text.encode()) for part in msg.content if isinstance(part, TextPart))
        total += len((msg.name or "").encode()) + len((msg.tool_call_id or "").encode())
        if msg.tool_calls is not None:
            total += _json_bytes(msg.tool_calls)
    return total


def _json_bytes(value) -> int:
    """Size of an already depth-checked JSON value as compact JSON."""
    return len(msgspec.json.encode(value))
