"""OpenAI API conformance through the official ``openai`` client, against one EPD fleet with
API keys on: every chat and completions parameter either works as specified or is a 400
``invalid_request_error`` whose ``param`` names it — none is ignored. Sampling controls are
checked against the in-process transformers engine given the same prompt ids and
``protocol.Sampling`` (the gateway's own ``PromptBuilder``); ``tests/e2e/test_skeleton.py``
checks the same seeded request in e-p-d (so epd and e-p-d draw the same tokens). vLLM's
``/tokenize``, ``/detokenize`` and ``/version`` against what the same fleet bills and refuses."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

from services.gateway import schema
from services.gateway.auth import hash_key
from services.gateway.prompt import PromptBuilder
from shared import protocol
from shared.engines.base import SampledToken
from shared.engines.sampling import stop_token_set
from shared.engines.transformers_engine import TransformersEngine
from shared.settings import Settings
from tests import procs

MODEL = "mmfleet-demo"
KEY = "sk-conformance"
MSGS = [{"role": "user", "content": "Tell me a story about the sea."}]
PROMPT = "Once upon a time"
# the seeded, sampled request with every sampling control that test_skeleton repeats in e-p-d
SEEDED = dict(temperature=0.9, top_p=0.95, seed=4321, max_tokens=16, presence_penalty=0.4, frequency_penalty=0.2,
              extra_body={"top_k": 30, "min_p": 0.02, "repetition_penalty": 1.2, "min_tokens": 4})


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, redis_url, model_dir, logs_dir):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
           "MMFLEET_REDIS_PREFIX": "conformance", "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024),
           "MMFLEET_API_KEY_HASHES": hash_key(KEY)}
    log_dir = logs_dir / "conformance"
    log_dir.mkdir()
    with procs.fleet(env, log_dir, mode="epd") as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=fleet + "/v1", api_key=KEY, max_retries=0, timeout=120)


def expected_text(model_dir, body: dict, *, chat: bool = True) -> tuple[str, int]:
    """(text, completion tokens) the in-process engine gives for ``body`` (an OpenAI request)."""
    text, n, _ = asyncio.run(_expected(model_dir, body, chat))
    return text, n


def expected_logprobs(model_dir, body: dict, *, chat: bool = True) -> list[protocol.TokenLogprob]:
    """The in-process engine's logprobs of the tokens that get text (stop tokens excluded)."""
    return asyncio.run(_expected(model_dir, body, chat))[2]


async def _expected(model_dir, body: dict, chat: bool):
    builder = PromptBuilder.for_model(model_dir, Settings())
    raw = json.dumps({"model": MODEL, **body}).encode()
    prepared = builder.chat(schema.parse_chat(raw)) if chat else builder.completion(schema.parse_completion(raw))
    engine = TransformersEngine(model_dir)
    await engine.start()
    try:
        ids = [t async for t in engine.generate("ref", prepared.prompt_token_ids, [], prepared.sampling)]
    finally:
        await engine.stop()
    stops = stop_token_set(prepared.sampling, engine.eos_token_ids)
    text = engine.tokenizer.decode([t for t in ids if t not in stops], skip_special_tokens=True)
    return text, len(ids), [t.logprob for t in ids if isinstance(t, SampledToken) and t not in stops]


def seeded_body() -> dict:
    """``SEEDED`` as the JSON body the client sends (for the in-process reference)."""
    extra = SEEDED["extra_body"]
    return {"messages": MSGS, **{k: v for k, v in SEEDED.items() if k != "extra_body"}, **extra}


# ---------------------------------------------------------------------------- refused by name
CHAT_REFUSED = [  # (keyword arguments of chat.completions.create, the param the 400 names)
    ({"n": 2}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "g"}}},
     "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"extra_body": {"structured_outputs": {"json": {}}}}, "structured_outputs"),
    ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"extra_body": {"allowed_token_ids": [1, 2]}}, "allowed_token_ids"),
    ({"extra_body": {"bad_words": ["sea"]}}, "bad_words"),
    ({"extra_body": {"include_stop_str_in_output": True}}, "include_stop_str_in_output"),
    ({"extra_body": {"skip_special_tokens": False}}, "skip_special_tokens"),
    ({"extra_body": {"echo": True}}, "echo"),
    ({"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),
    ({"extra_body": {"mm_processor_kwargs": {"do_resize": False}}}, "mm_processor_kwargs.do_resize"),
    ({"extra_body": {"mm_processor_kwargs": {"max_pixels": -1}}}, "mm_processor_kwargs.max_pixels"),
    ({"extra_body": {"continue_final_message": True}}, "continue_final_message"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_tokens": 99}}, "min_tokens"),
    ({"extra_body": {"stop_token_ids": [10**9]}}, "stop_token_ids"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"sea": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
]


@pytest.mark.parametrize(("kwargs", "param"), CHAT_REFUSED, ids=[p for _, p in CHAT_REFUSED])
def test_chat_parameter_refused_by_name(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSGS, **{"max_tokens": 4, **kwargs})
    err = info.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function"}]}], "messages[1].tool_calls[0]"),
    ([{"role": "function", "name": "f", "content": "1"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png",
                                                                         "detail": "ultra"}}]}],
     "messages[0].content[0].image_url.detail"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}], "messages[0].cache_control"),
])
def test_message_fields_refused_by_name(client, messages, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert info.value.body["param"] == param, info.value.body


COMPLETION_REFUSED = [
    ({"n": 2}, "n"), ({"logprobs": 21}, "logprobs"), ({"echo": True}, "echo"), ({"suffix": "end"}, "suffix"),
    ({"best_of": 2}, "best_of"), ({"extra_body": {"response_format": {"type": "yaml"}}}, "response_format.type"),
    ({"extra_body": {"unknown_thing": True}}, "unknown_thing"), ({"logit_bias": {"-1": 5}}, "logit_bias"),
]


@pytest.mark.parametrize(("kwargs", "param"), COMPLETION_REFUSED, ids=[p for _, p in COMPLETION_REFUSED])
def test_completion_parameter_refused_by_name(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 4, **kwargs})
    assert info.value.body["param"] == param, info.value.body


# ---------------------------------------------------------------------------- accepted, and doing what they say
def test_no_op_fields_at_their_default_values_are_accepted(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=3, temperature=0, n=1, logprobs=False, user="u1", store=False,
        metadata={"k": "v"}, service_tier="auto", parallel_tool_calls=True, tool_choice="none",
        response_format={"type": "text"}, modalities=["text"],
        extra_body={"skip_special_tokens": True, "add_generation_prompt": True, "echo": False, "priority": 0,
                    "chat_template_kwargs": {}})
    assert out.choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_controls_equal_the_in_process_engine(client, model_dir):
    expected, _ = expected_text(model_dir, seeded_body())
    whole = client.chat.completions.create(model=MODEL, messages=MSGS, **SEEDED).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(model=MODEL, messages=MSGS, stream=True, **SEEDED))
    assert whole == expected and streamed == expected
    unseeded = {**SEEDED, "seed": 4322}
    assert client.chat.completions.create(model=MODEL, messages=MSGS, **unseeded).choices[0].message.content != expected


def test_logit_bias_stop_token_ids_ignore_eos_and_min_tokens(client, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sea = tok(" sea", add_special_tokens=False)["input_ids"][0]
    forced = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=6,
                                            logit_bias={str(sea): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].message.content == tok.decode([sea] * 6, skip_special_tokens=True)
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 6
    # sea is forced from token 3 on, and ends the completion as a stop token (not in the text)
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8,
                                        logit_bias={str(sea): 100},
                                        extra_body={"stop_token_ids": [sea], "min_tokens": 3})
    expected, n = expected_text(model_dir, {"prompt": PROMPT, "temperature": 0, "max_tokens": 8,
                                            "logit_bias": {str(sea): 100}, "stop_token_ids": [sea],
                                            "min_tokens": 3}, chat=False)
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == n == 4


def test_top_k_1_is_greedy_and_penalties_follow_the_engine(client, model_dir):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=10).choices[0].text
    top1 = client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=3, max_tokens=10,
                                     extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 10, "frequency_penalty": 1.5,
            "presence_penalty": 1.0, "repetition_penalty": 1.8}
    got = client.completions.create(model=MODEL, **{k: v for k, v in body.items() if k != "repetition_penalty"},
                                    extra_body={"repetition_penalty": 1.8}).choices[0].text
    assert got == expected_text(model_dir, body, chat=False)[0]


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-3  # padded batched decode vs one sequence: float rounding only


def test_chat_logprobs_whole_and_streamed_equal_the_in_process_engine(client, model_dir):
    kw = dict(temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    want = expected_logprobs(model_dir, {"messages": MSGS, **kw})
    whole = client.chat.completions.create(model=MODEL, messages=MSGS, **kw).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(model=MODEL, messages=MSGS, stream=True, **kw)
              if c.choices]
    streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for entries in (whole.logprobs.content, streamed):
        assert len(entries) == len(want) >= 1
        for got, exp in zip(entries, want, strict=True):
            assert got.token == tok.decode([exp.token_id]) and got.bytes == list(got.token.encode())
            assert _close(got.logprob, exp.logprob)
            assert [t.token for t in got.top_logprobs] == [tok.decode([t]) for t, _ in exp.top]
            assert all(_close(t.logprob, v) for t, (_, v) in zip(got.top_logprobs, exp.top, strict=True))
            assert got.top_logprobs[0].logprob >= got.logprob - 1e-6  # greedy: the top token is the chosen one


def test_completion_logprobs_shape(client, model_dir):
    out = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=2).choices[0]
    want = expected_logprobs(model_dir, {"prompt": PROMPT, "temperature": 0, "max_tokens": 5, "logprobs": 2},
                             chat=False)
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(want)
    assert all(_close(g, w.logprob) for g, w in zip(lp.token_logprobs, want, strict=True))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(d) in (2, 3) for d in lp.top_logprobs)  # the top 2, and the sampled token
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=2, stream=True) if c.choices[0].logprobs]
    assert [t for c in streamed for t in c.tokens] == lp.tokens
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}}}


def check_structured_output(client, model_dir, temperature: float = 1.0) -> None:
    """json_schema (strict) and json_object answers, whole and streamed, parse (and validate)
    even from the random demo model; used by the mode tests for every (mode, engine) pair (the
    vLLM engine at temperature 0: see params.check_structured_engine)."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in (1, 2):
        kw = dict(model=MODEL, messages=MSGS, max_tokens=120, temperature=temperature, seed=seed, response_format=fmt)
        whole = client.chat.completions.create(**kw).choices[0]
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        assert whole.finish_reason == "stop", whole
        jsonschema.validate(json.loads(whole.message.content), SCHEMA)
        assert streamed == whole.message.content
    # json_object: nothing bounds an object's length and the random model never closes one by
    # itself, so the closing characters are nudged (the grammar still decides what is allowed)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    nudge = {str(tok.convert_tokens_to_ids(c)): 8 for c in ('"', "}")}
    obj = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=temperature, seed=5,
                                         logit_bias=nudge, response_format={"type": "json_object"}).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict)


def test_structured_output(client, model_dir):
    check_structured_output(client, model_dir)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
]
HISTORY = [{"role": "user", "content": "What is 1 + 2, and the weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "3"}]


def _valid_call(call) -> None:
    import jsonschema

    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.type == "function" and call.id.startswith("call_")


def check_tool_calls(client, temperature: float = 1.0) -> None:
    """Forced calls (named, required; whole and streamed as deltas) parse and validate even from
    the random demo model; auto and none answer; a history with tool results is accepted."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        kw = dict(model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice=choice, max_tokens=80,
                  temperature=temperature, seed=11)
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1, whole
        _valid_call(whole.message.tool_calls[0])
        if choice == named:
            assert whole.message.tool_calls[0].function.name == "get_weather"
        parts, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            c = chunk.choices[0]
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                got = parts.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += (d.function.name or "") if d.function else ""
                got["arguments"] += (d.function.arguments or "") if d.function else ""
        assert finish == "tool_calls" and len(parts) == 1
        assert parts[0]["name"] == whole.message.tool_calls[0].function.name
        assert json.loads(parts[0]["arguments"]) == json.loads(whole.message.tool_calls[0].function.arguments)
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice=choice,
                                             max_tokens=8, temperature=0).choices[0]
        assert out.finish_reason in ("stop", "length", "tool_calls")
        if choice == "none":
            assert not out.message.tool_calls


def test_tool_calls(client):
    check_tool_calls(client)


def test_include_usage_gives_null_usage_until_the_last_chunk(client, fleet):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens >= 1
    # on the wire: every chunk has the key, null until the last (as OpenAI sends it)
    body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 4, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(fleet + "/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [ln[6:] for ln in resp.read().decode().splitlines() if ln.startswith("data: ")]
    objs = [json.loads(ln) for ln in lines if ln != "[DONE]"]
    assert all("usage" in o for o in objs) and all(o["usage"] is None for o in objs[:-1])
    assert objs[-1]["usage"]["completion_tokens"] >= 1


def test_models_follow_the_api_key_rule(client, fleet):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    for path in ("/v1/models", f"/v1/models/{MODEL}"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(fleet + path, timeout=5)
        assert info.value.code == 401
    anonymous = openai.OpenAI(base_url=fleet + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()


def test_pixel_budget_and_detail_change_the_image_tokens(client):
    """The same image bytes under different budgets are different inputs (fewer prompt tokens),
    encoded apart rather than answered from the embedding cache of another budget."""
    from tests.e2e.test_skeleton import noise_image, png_data_url

    url = png_data_url(noise_image(3, size=(320, 240)))

    def prompt_tokens(detail=None, **kw) -> int:
        part = {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
        return client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, messages=[
            {"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], **kw).usage.prompt_tokens

    full = prompt_tokens()
    small = prompt_tokens(extra_body={"mm_processor_kwargs": {"max_pixels": 112 * 112}})
    assert small < full and prompt_tokens("high") == full and prompt_tokens() == full


# ---------------------------------------------------------------------------- vLLM's /tokenize, /detokenize, /version
def _call(fleet: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(fleet + path, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_tokenize_counts_the_prompt_tokens_the_fleet_bills(client, fleet):
    """Text, chat, and a chat with an inline image (counted at the gateway; expanded by prefill)."""
    from tests.e2e.test_skeleton import noise_image, png_data_url

    image = {"type": "image_url", "image_url": {"url": png_data_url(noise_image(5, size=(320, 240)))}}
    with_image = [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]
    billed = {
        "text": client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.prompt_tokens,
        "chat": client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1).usage.prompt_tokens,
        "image": client.chat.completions.create(model=MODEL, messages=with_image, max_tokens=1).usage.prompt_tokens,
    }
    for name, fields in (("text", {"prompt": PROMPT}), ("chat", {"messages": MSGS}),
                         ("image", {"messages": with_image})):
        status, out = _call(fleet, "/tokenize", {"model": MODEL, **fields})
        assert status == 200 and out["count"] == len(out["tokens"]) == billed[name], (name, out)
        assert out["max_model_len"] == 4096 and out["token_strs"] is None
    status, out = _call(fleet, "/tokenize", {"model": MODEL, "messages": MSGS, "return_token_strs": True})
    status, back = _call(fleet, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert status == 200 and back["prompt"].startswith("<|im_start|>") and MSGS[0]["content"] in back["prompt"]
    assert len(out["token_strs"]) == out["count"]


def test_tokenize_detokenize_and_version_refusals(fleet):
    from services.version import version

    assert _call(fleet, "/version") == (200, {"version": version()})
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}), ("/version", None)):
        status, err = _call(fleet, path, body, key=None)
        assert status == 401 and err["error"]["code"] == "missing_api_key", path
    url_image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    for path, body, param in (("/tokenize", {"messages": [{"role": "user", "content": [url_image]}]},
                               "messages[0].content[0]"),
                              ("/tokenize", {"prompt": "x", "max_tokens": 1}, "max_tokens"),
                              ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens")):
        status, err = _call(fleet, path, body)
        assert status in (400, 404) and err["error"]["param"] == param, (path, err)


def test_completions_take_one_prompt_as_text_or_token_ids(client, fleet):
    ids = _call(fleet, "/tokenize", {"model": MODEL, "prompt": PROMPT})[1]["tokens"]
    want = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    for prompt in ([PROMPT], ids, [ids]):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert got.choices[0].text == want and got.usage.prompt_tokens == len(ids), prompt
    for prompt in ([PROMPT, PROMPT], [ids, ids], [10**9]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert info.value.body["param"] == "prompt", prompt
