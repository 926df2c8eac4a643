"""What the gateway does with each request field: use it, accept it as a no-op that cannot
change the answer, or refuse it by name — never drop it unseen.

Contract: :func:`check_fields` raises ``RequestFailed`` (400 ``invalid_request_error``,
``param`` = the field, ``code`` ``unsupported_parameter``) for the first field whose value asks
for behaviour mmfleet does not have; a field at a value equal to what mmfleet does anyway (e.g.
``logprobs: false``, ``best_of: 1``) passes. :func:`sampling` validates the sampling controls
(ranges as vLLM checks them) into the ``protocol.Sampling`` every engine applies.
Design: docs/guide/api.md (its support matrix lists the same decisions).
"""

from __future__ import annotations

import json

from services.gateway.defaults import GenerationDefaults
from services.gateway.defaults import max_tokens as default_max_tokens
from shared import protocol
from shared.settings import Settings
from shared.stage import RequestFailed

# field: (values that leave the answer as mmfleet gives it anyway, why any other is refused)
_SHARED: dict[str, tuple[tuple, str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1.0,), "length_penalty applies to beam search, which is not supported"),
    "include_stop_str_in_output": ((False,), "stop strings are never included in the output"),
    "skip_special_tokens": ((True,), "special tokens are always skipped in the output text"),
    "spaces_between_special_tokens": ((True,), "not configurable on this server"),
    "truncate_prompt_tokens": ((), "prompts are never truncated; a prompt beyond the context is a 400"),
    "prompt_logprobs": ((), "prompt logprobs are not supported"),
    "allowed_token_ids": ((), "allowed_token_ids is not supported; use logit_bias"),
    "bad_words": ((), "bad_words is not supported; use logit_bias"),
    "structured_outputs": ((), "structured outputs are not supported yet"),
    "guided_json": ((), "guided decoding is not supported yet"),
    "guided_regex": ((), "guided decoding is not supported yet"),
    "guided_choice": ((), "guided decoding is not supported yet"),
    "guided_grammar": ((), "guided decoding is not supported yet"),
    "guided_decoding_backend": ((), "guided decoding is not supported yet"),
    "priority": ((0,), "request priorities are not supported"),
    "request_id": ((), "the server assigns request ids (see the response's id)"),
    "return_tokens_as_token_ids": ((False,), "not supported"),
    "echo": ((False,), "echo is not supported"),
}
_CHAT: dict[str, tuple[tuple, str]] = {
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "the served model does not reason"),
    "verbosity": ((), "verbosity is not supported"),
    "web_search_options": ((), "web search is not supported"),
    "add_generation_prompt": ((True,), "the generation prompt is always added"),
    "continue_final_message": ((False,), "continue_final_message is not supported"),
    "documents": ((), "documents are not supported"),
}
_COMPLETION: dict[str, tuple[tuple, str]] = {
    "suffix": (("",), "suffix (insertion) is not supported"),
    "best_of": ((1,), "best_of > 1 is not supported; send separate requests"),
}
# fields of a message beyond role / content / name
_MESSAGE: dict[str, str] = {
    "function_call": "function calling is not supported",
    "refusal": "assistant refusals in the history are not supported",
    "audio": "audio output references are not supported",
}
LOGIT_BIAS_MAX_ENTRIES = 300  # OpenAI's documented bound on logit_bias keys
STOP_TOKEN_IDS_MAX = 64
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI: 20 for chat, 5 for completions)


def _refuse(param: str, why: str) -> RequestFailed:
    return RequestFailed.bad_request(f"{param}: {why}", param=param, code="unsupported_parameter")


def check_fields(req, *, chat: bool) -> None:
    """Refuse (400, by name) the first field asking for what this server does not do."""
    for name, (ok, why) in {**_SHARED, **(_CHAT if chat else _COMPLETION)}.items():
        value = getattr(req, name)
        if value is not None and value not in ok:
            raise _refuse(name, why)
    if req.n not in (None, 1):
        raise _refuse("n", "n > 1 is not supported; send separate requests")
    if req.stream_options is not None:
        if not req.stream:
            raise RequestFailed.bad_request("stream_options is only allowed when stream is true",
                                            param="stream_options")
        if req.stream_options.continuous_usage_stats:
            raise _refuse("stream_options.continuous_usage_stats", "usage comes in the final chunk only")
    if not chat:
        return
    for i, msg in enumerate(req.messages):
        if msg.role == "function":
            raise _refuse(f"messages[{i}].role", "function messages (the deprecated function calling) are not "
                                                 "supported; use tools and role tool")
        for name, why in _MESSAGE.items():
            if getattr(msg, name) is not None:
                raise _refuse(f"messages[{i}].{name}", why)


def sampling(req, settings: Settings, max_tokens: int | None, vocab_size: int,
             max_tokens_param: str = "max_tokens", *, context_tokens: int, prompt_len: int,
             defaults: GenerationDefaults = GenerationDefaults()) -> protocol.Sampling:
    """The request's sampling controls, range-checked (400 naming the field; ``max_tokens_param``:
    the field ``max_tokens`` came from). A field the request leaves out takes the model's
    generation-config default (``defaults``), else the API's; max_tokens: see
    :func:`services.gateway.defaults.max_tokens` (``prompt_len``: the prompt's tokens here)."""
    def bad(param: str, message: str) -> RequestFailed:
        return RequestFailed.bad_request(f"{param} {message}", param=param)

    d = defaults
    temperature = d.pick("temperature", req.temperature)
    temperature = 1.0 if temperature is None else temperature
    top_p = d.pick("top_p", req.top_p)
    top_p = 1.0 if top_p is None else top_p
    if not 0.0 <= temperature <= 2.0:
        raise bad("temperature", "must be between 0 and 2")
    if not 0.0 < top_p <= 1.0:
        raise bad("top_p", "must be in (0, 1]")
    limit = min(context_tokens, settings.max_tokens_limit) if settings.max_tokens_limit else context_tokens
    if max_tokens is not None and not 1 <= max_tokens <= limit:
        raise bad(max_tokens_param, f"must be between 1 and {limit}")
    max_tokens = default_max_tokens(max_tokens, d, default_cap=settings.default_max_tokens,
                                    context_left=context_tokens - prompt_len)
    max_tokens = min(max_tokens, limit)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > 4 or any(not s for s in stop):
        raise bad("stop", "takes up to 4 non-empty strings")
    top_k = d.pick("top_k", req.top_k)
    top_k = 0 if top_k in (None, -1) else top_k
    if top_k < 0:
        raise bad("top_k", "must be -1 or 0 (off) or a positive number of tokens")
    min_p = d.pick("min_p", req.min_p) or 0.0
    if not 0.0 <= min_p <= 1.0:
        raise bad("min_p", "must be between 0 and 1")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = d.pick(name, getattr(req, name)) or 0.0
        if not -2.0 <= value <= 2.0:
            raise bad(name, "must be between -2 and 2")
        penalties[name] = float(value)
    repetition = d.pick("repetition_penalty", req.repetition_penalty)
    repetition = 1.0 if repetition is None else repetition
    if not 0.0 < repetition <= 2.0:
        raise bad("repetition_penalty", "must be in (0, 2]")
    min_tokens = req.min_tokens or 0
    if not 0 <= min_tokens <= max_tokens:
        raise bad("min_tokens", "must be between 0 and max_tokens")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad("seed", "must fit in 64 bits")
    return protocol.Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=req.seed, stop=stop,
                             logprobs=_logprobs(req), structured=structured_output(req.response_format),
                             top_k=top_k, min_p=float(min_p), repetition_penalty=float(repetition),
                             min_tokens=min_tokens, ignore_eos=bool(req.ignore_eos),
                             logit_bias=_logit_bias(req.logit_bias, vocab_size),
                             stop_token_ids=_token_ids(req.stop_token_ids, vocab_size), **penalties)


def check_structured_engine(sampling: protocol.Sampling, settings: Settings, param: str) -> None:
    """With the vLLM engine, grammar-constrained output is served at temperature 0 only: sampled
    completions were seen to leave the grammar (2 of 12 seeds at engine level came out
    unparseable, cause not found yet), so they are refused by name rather than returned broken."""
    if sampling.structured is not None and sampling.temperature > 0 and settings.engine == "vllm":
        raise _refuse(param, "with the vLLM engine, structured output (response_format json_object / "
                             "json_schema, a forced tool call) needs temperature 0 for now")


def structured_output(response_format) -> protocol.StructuredOutput | None:
    """``response_format`` → the grammar engines enforce: ``text`` none, ``json_object`` any JSON
    object, ``json_schema`` its ``schema`` (enforced whether ``strict`` or not, as vLLM does)."""
    from shared.engines.structured import GrammarError, check

    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return protocol.StructuredOutput("json_object")
    if kind != "json_schema":
        raise RequestFailed.bad_request("response_format.type must be text, json_object or json_schema",
                                        param="response_format.type")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise RequestFailed.bad_request("response_format.json_schema.schema must be a JSON Schema object",
                                        param="response_format.json_schema.schema")
    out = protocol.StructuredOutput("json_schema", json.dumps(schema))
    try:
        check(out)
    except GrammarError as exc:
        raise RequestFailed.bad_request(f"response_format.json_schema.schema: {exc}",
                                        param="response_format.json_schema.schema") from None
    return out


DETAIL_LOW_MAX_PIXELS = 512 * 512  # image_url.detail "low": at most OpenAI's low-detail 512x512 budget


def max_request_pixels(settings: Settings, *, token_pixels: int, context_tokens: int) -> int:
    """The most pixels ``mm_processor_kwargs`` min_pixels / max_pixels may name: what makes no more
    image tokens (``token_pixels`` each) than ``max_image_tokens`` or the model's context, as
    min_pixels scales even a 1x1 image up to it; never above ``max_image_pixels``."""
    return min(settings.max_image_pixels, min(settings.max_image_tokens, context_tokens) * token_pixels)


def pixel_budget(mm_processor_kwargs, *, supported: bool, max_pixels: int) -> tuple[int, int]:
    """(min_pixels, max_pixels) for the request's images from ``mm_processor_kwargs`` (0: the
    processor's own), each at most ``max_pixels`` (:func:`max_request_pixels`); only the two Qwen
    image-processor keys are taken, where the family has them."""
    if not mm_processor_kwargs:
        return 0, 0
    if not isinstance(mm_processor_kwargs, dict):
        raise RequestFailed.bad_request("mm_processor_kwargs must be an object", param="mm_processor_kwargs")
    for key in mm_processor_kwargs:
        if key not in ("min_pixels", "max_pixels") or not supported:
            raise _refuse(f"mm_processor_kwargs.{key}", "this server's model takes min_pixels and max_pixels only"
                          if supported else "the served model's processor takes no per-request options")
    lo, hi = mm_processor_kwargs.get("min_pixels", 0), mm_processor_kwargs.get("max_pixels", 0)
    for name, value in (("min_pixels", lo), ("max_pixels", hi)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= max_pixels:
            raise RequestFailed.bad_request(f"mm_processor_kwargs.{name} must be an integer from 0 to {max_pixels} "
                                            "(the pixels this server lets one image become)",
                                            param=f"mm_processor_kwargs.{name}")
    if lo and hi and lo > hi:
        raise RequestFailed.bad_request("mm_processor_kwargs.min_pixels exceeds max_pixels",
                                        param="mm_processor_kwargs.min_pixels")
    return lo, hi


def media_limits(counts: dict[str, int], settings: Settings) -> None:
    """Per-modality limits (``max_<kind>s_per_request``): 400 naming the modality beyond them."""
    for kind, limit in (("image", settings.max_images_per_request), ("video", settings.max_videos_per_request),
                        ("audio", settings.max_audios_per_request)):
        if limit and counts.get(kind, 0) > limit:
            raise RequestFailed(400, f"request has {counts[kind]} {kind} items; this server takes at most {limit}",
                                param="messages", code="too_many_media_items")


def _logprobs(req) -> int | None:
    """How many top alternatives to return per token (None: no logprobs): chat ``logprobs``
    (bool) + ``top_logprobs``, completions ``logprobs`` (int)."""
    if hasattr(req, "top_logprobs"):  # chat
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise RequestFailed.bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise RequestFailed.bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}",
                                            param="top_logprobs")
        return (top or 0) if req.logprobs else None
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise RequestFailed.bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
    return req.logprobs


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
        raise RequestFailed.bad_request(f"logit_bias takes at most {LOGIT_BIAS_MAX_ENTRIES} tokens",
                                        param="logit_bias")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:  # ("²".isdigit(), int() fails)
            raise RequestFailed.bad_request(f"logit_bias key {key!r} is not a token id of this model "
                                            f"(0..{vocab_size - 1})", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestFailed.bad_request(f"logit_bias value for token {key} must be between -100 and 100",
                                            param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _token_ids(ids: list[int] | None, vocab_size: int) -> tuple[int, ...]:
    if not ids:
        return ()
    if len(ids) > STOP_TOKEN_IDS_MAX or any(not 0 <= t < vocab_size for t in ids):
        raise RequestFailed.bad_request(f"stop_token_ids takes at most {STOP_TOKEN_IDS_MAX} token ids of this "
                                        f"model (0..{vocab_size - 1})", param="stop_token_ids")
    return tuple(sorted(set(ids)))
