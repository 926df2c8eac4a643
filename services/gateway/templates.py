"""Chat templates as real checkpoints keep them, and as vLLM lets requests choose them.

- ``model_chat_template(override, processor, tokenizer)``: the ``chat_template`` setting (a path
  or the text), else the processor's (what ``generate()`` uses), else the tokenizer's, else None
  (chat requests are then a 400 saying so).
- ``render_chat(...)``: the prompt text. A request's ``chat_template`` is honoured only where
  ``trust_request_chat_template`` allows (else a 400, as vLLM does); ``chat_template_kwargs``
  become template variables; a key naming an ``apply_chat_template`` parameter, or a template
  that fails to render, is a 400 naming the field. Design: docs/guide/models.md.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from shared.stage import RequestFailed

# apply_chat_template's own parameters (read from its signature, ``self`` and ``kwargs`` included:
# either would collide with the call), and ``messages``: not template variables, a request may not set them
_RESERVED_KWARGS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) | {"messages"}


def load_template_setting(value: str) -> str:
    """The ``chat_template`` setting's template: a path that exists is read; text with Jinja
    markup is the template; anything else is a start-up error (a mistyped path, most likely)."""
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template setting {value!r} is neither an existing file nor a Jinja template")


def model_chat_template(override: str, processor, tokenizer) -> str | None:
    if override:
        return load_template_setting(override)
    return getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)


def render_chat(tokenizer, template: str | None, messages: list[dict], request, *,
                trust_request_template: bool, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """``tools``: the request's tools in the template's own form (a template that renders them).
    ``continue_final_message`` (/tokenize): the last message left open, as vLLM renders it."""
    import jinja2

    param = "messages"
    requested = request.chat_template
    if requested is not None:
        if not trust_request_template:
            raise RequestFailed.bad_request("chat_template in a request is not accepted by this server (its "
                                            "operator has not set trust_request_chat_template)",
                                            param="chat_template")
        template, param = requested, "chat_template"
    if template is None:
        raise RequestFailed.bad_request("the served model has no chat template; send one as chat_template "
                                        "(if the server allows it) or use /v1/completions", param="messages")
    kwargs = dict(request.chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & _RESERVED_KWARGS)
    if reserved:
        raise RequestFailed.bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: they are "
                                        "parameters of the rendering, not template variables",
                                        param="chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **({"tools": tools} if tools else {}), **kwargs)
    except jinja2.TemplateError as exc:
        raise RequestFailed.bad_request(f"the chat template failed to render: {exc}", param=param) from None
    except TypeError as exc:  # a template variable the rendering call takes as an argument of its own
        raise RequestFailed.bad_request(f"chat_template_kwargs cannot be passed to the template: {exc}",
                                        param="chat_template_kwargs") from None
    except ValueError as exc:  # transformers': the final message cannot be continued (not found once rendered)
        if not continue_final_message:
            raise
        raise RequestFailed.bad_request(f"continue_final_message: {exc}", param="continue_final_message") from None
