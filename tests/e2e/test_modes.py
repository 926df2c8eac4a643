"""Parity across deployment modes and engines: every supported (mode, engine) pair gives, at
temperature 0, exactly the tokens of in-process ``generate()`` for a text, a one-image and a
two-image prompt, streamed and whole; an engine lacking what a layout needs is refused at
start-up saying why. vLLM fleets serve a copy of the model whose generation config sets sampling
defaults, and also answer a video and a request without sampling fields as vLLM's own offline
``LLM.generate`` does on the raw media (tests/e2e/vllm_checks.py). Each pair is a real fleet
(``mmfleet up --mode M``, ``MMFLEET_ENGINE``) on the shared broker and Redis; m-e-p-d with
transformers is covered by test_skeleton.py. The e-p-d vLLM fleet then has its decode and prefill
workers killed under load (nothing lost or duplicated). vLLM in e-p-d and ep-d moves the KV engine
to engine (NixlConnector): equal tokens mean the KV really moved (decode's engine never sees the
images)."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from tests import procs
from tests.chaos.load import reference_texts
from tests.chaos.test_kill_workers import VLLM_FLEET_ENV, check_vllm_kills
from tests.e2e.test_api_conformance import check_structured_output, check_tool_calls
from tests.e2e.test_skeleton import gradient_image, noise_image, png_data_url, ref_parts, reference_text
from tests.e2e.vllm_checks import Expected, clip, tuned_copy
from tests.vllm_offline import Case

MAX_TOKENS = 12
PROMPTS = {
    "text": ([], "Tell me a story about the sea."),
    "one-image": ([noise_image(1)], "Describe what you see."),
    "two-images": ([noise_image(1), gradient_image()], "Compare the two pictures."),
}
HAS_VLLM = importlib.util.find_spec("vllm") is not None
KILLED = ("e-p-d", "vllm")  # the pair whose fleet also runs the vLLM chaos check (tests/chaos)

PAIRS = [
    ("epd", "transformers"), ("e-pd", "transformers"), ("e-p-d", "transformers"), ("ep-d", "transformers"),
    pytest.param("epd", "vllm", marks=pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")),
    *(pytest.param(mode, "vllm", marks=pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed"))
      for mode in ("e-pd", "e-p-d", "ep-d")),
]


@pytest.fixture(scope="module")
def references(model_dir) -> dict[str, str]:
    return {name: reference_text(model_dir, ref_parts(len(imgs), text) if imgs else text, imgs)
            for name, (imgs, text) in PROMPTS.items()}


@pytest.fixture(scope="module")
def vllm_expected(model_dir, tmp_path_factory):
    """vLLM's offline answers on the model copy vLLM fleets serve: the prompts above and a video."""
    tuned = tuned_copy(model_dir, tmp_path_factory.mktemp("tuned") / "qwen2-vl")
    raw, video = clip()
    cases = {name: (Case(text, imgs, max_tokens=MAX_TOKENS), []) for name, (imgs, text) in PROMPTS.items()}
    cases["video"] = (Case("Describe the clip.", videos=[(video.frames, video.sampled_fps)], max_tokens=MAX_TOKENS),
                      [raw])
    expected = Expected(tuned, cases, tmp_path_factory.mktemp("vllm-offline"))  # runs while the fleet starts
    yield expected
    expected.close()


def _content(imgs, text):
    if not imgs:
        return text
    return [*({"type": "image_url", "image_url": {"url": png_data_url(i)}} for i in imgs),
            {"type": "text", "text": text}]


@pytest.mark.parametrize(("mode", "engine"), PAIRS)
def test_mode_engine_parity(mode, engine, kafka_bootstrap, redis_url, model_dir, logs_dir, references, request):
    # each fleet gets its own key prefix and consumer groups' worth of topics are shared: a
    # fleet stops before the next starts, so no two fleets consume at once
    expected = request.getfixturevalue("vllm_expected") if engine == "vllm" else None
    served = expected.model_dir if expected is not None else model_dir
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(served),
           "MMFLEET_ENGINE": engine, "MMFLEET_REDIS_PREFIX": f"{mode}-{engine}",
           "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024), **(VLLM_FLEET_ENV if (mode, engine) == KILLED else {})}
    log_dir = logs_dir / f"{mode}-{engine}"
    log_dir.mkdir()
    with procs.fleet(env, log_dir, mode=mode, ready_timeout_s=300) as (base, supervisor):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        for name, (imgs, text) in PROMPTS.items():
            kwargs = dict(model="mmfleet-demo", temperature=0, max_tokens=MAX_TOKENS,
                          messages=[{"role": "user", "content": _content(imgs, text)}])
            whole = client.chat.completions.create(**kwargs).choices[0].message.content
            streamed = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(stream=True, **kwargs) if c.choices)
            assert whole == references[name], f"{mode}/{engine}/{name}"
            assert streamed == references[name], f"{mode}/{engine}/{name} (stream)"
        if expected is not None:  # a video, and a request without sampling fields, as vLLM answers them
            for name in PROMPTS:  # vLLM on the raw images and transformers' generate() agree
                assert expected.texts[name] == references[name], name
            expected.check_fleet(client, f"{mode}/{engine}")
        # response_format and forced tool calls in this mode and engine; vLLM serves them greedy
        # only and refuses them sampled, by name (services/gateway/params.check_structured_engine)
        temperature = 0.0 if engine == "vllm" else 1.0
        check_structured_output(client, model_dir, temperature)
        check_tool_calls(client, temperature)
        if engine == "vllm":
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="mmfleet-demo", max_tokens=8, temperature=0.7, messages=[
                    {"role": "user", "content": "hi"}], response_format={"type": "json_object"})
            assert info.value.body["param"] == "response_format"
        if (mode, engine) == KILLED:  # the same fleet then loses its vLLM decode and prefill workers under load
            check_vllm_kills(base, supervisor.pid, reference_texts(model_dir))


def test_engine_without_kv_transfer_is_refused_with_a_clear_message():
    """A layout the engine cannot serve fails before any traffic (both shipped engines can run
    every mode, so the check is shown with an engine lacking KV export/import)."""
    from services.modes import UnsupportedLayout, check_engine
    from shared.engines.base import Capabilities

    generate_only = Capabilities(encode=False, generate=True, kv_export=False, kv_import=False)
    with pytest.raises(UnsupportedLayout, match="cannot run prefill apart from decode.*kv_export.*epd, e-pd"):
        check_engine(("prefill",), "x", generate_only)
    with pytest.raises(UnsupportedLayout, match="cannot run decode apart from prefill.*kv_import"):
        check_engine(("decode",), "x", generate_only)
