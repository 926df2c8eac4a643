"""vLLM prefill and decode apart: a kv_producer engine prefills, a kv_consumer engine reads
the KV over NIXL (vLLM's NixlConnector, CPU buffers) and decodes. Greedy tokens must equal
one-process ``generate()``; the consumer never sees the images (zero placeholders), so equal
tokens mean the KV really moved. Two engines for the module (~30-60 s of start-up here).
"""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("vllm")

from shared import protocol  # noqa: E402
from shared.engines import vllm_pd  # noqa: E402
from shared.engines.vllm_engine import VllmEngine  # noqa: E402
from shared.transfer import OwnerGoneError  # noqa: E402
from tests.engines.test_vllm_engine import CASES, GREEDY, cases, collect, compute, reference  # noqa: E402,F401


@pytest.fixture(scope="module")
async def pair(model_dir):
    producer = VllmEngine(model_dir, kv_cache_bytes=128 << 20, kv_role=vllm_pd.PRODUCER, kv_lease_s=20)
    consumer = VllmEngine(model_dir, kv_cache_bytes=128 << 20, kv_role=vllm_pd.CONSUMER)
    try:
        await producer.start()
        await consumer.start()
        yield producer, consumer
    finally:
        await consumer.stop()
        await producer.stop()


async def handoff(pair, rid: str, prompt_ids, images, sampling=GREEDY, resume=()) -> list[int]:
    producer, consumer = pair
    out = await producer.prefill(rid, list(prompt_ids), images, sampling)
    assert out.kv is None and out.engine_kv is not None
    wire = protocol.decoder_for(protocol.EngineKv).decode(protocol.encode(out.engine_kv))  # as on Kafka
    rest = await collect(consumer.decode_remote(rid, list(prompt_ids), wire, out.first_token, sampling, resume))
    return [out.first_token, *rest]


@pytest.mark.parametrize("name", list(CASES))
async def test_greedy_handoff_matches_generate(pair, cases, name):  # noqa: F811 (fixture)
    prompt_ids, images, expected = cases[name]
    assert await handoff(pair, f"pd-{name}", prompt_ids, images) == expected


async def test_resume_continues_after_logged_tokens(pair, cases):  # noqa: F811 (fixture)
    """A decode that runs again (a restarted attempt) forces the logged tokens and goes on."""
    prompt_ids, images, expected = cases["one_image"]
    got = await handoff(pair, "pd-resume", prompt_ids, images, resume=tuple(expected[1:5]))
    assert got == expected


async def test_unreachable_producer_is_owner_gone(pair, cases):  # noqa: F811 (fixture)
    """A producer that cannot be reached (here: an engine id nobody has, at a closed port; in a
    fleet: a prefill worker that died) ends the read with OwnerGoneError, which makes the runner
    restart the request from its source; the consumer never computes without the KV."""
    producer, consumer = pair
    prompt_ids, images, _ = cases["one_image"]
    out = await producer.prefill("pd-gone", list(prompt_ids), images, GREEDY)
    gone = msgspec.structs.replace(out.engine_kv, remote_engine_id="mmfleet-nobody",
                                   remote_port=vllm_pd.free_port("127.0.0.1"))
    with pytest.raises(OwnerGoneError):
        await collect(consumer.decode_remote("pd-gone", list(prompt_ids), gone, out.first_token, GREEDY))


async def test_controls_structured_output_and_logprobs_across_the_handoff(pair, compute, model_dir):  # noqa: F811
    """The split draws what the transformers engine draws: min_tokens discounted by prefill's
    token, the grammar continued after it and presence / frequency penalties counting it
    (shared.engines.vllm_structured), logprobs of both halves."""
    import json

    import jsonschema

    from tests.engines.test_vllm_engine import assert_same, messages_for, transformers_tokens
    from tests.unit.test_structured_output import SCHEMA

    prompt = compute.render_prompt_ids(messages_for(0, "Tell me a story about the sea."))
    controls = protocol.Sampling(max_tokens=16, temperature=0.0, repetition_penalty=1.3, ignore_eos=True,
                                 presence_penalty=0.8, frequency_penalty=0.6,
                                 logit_bias=((11, 3.0), (13, -100.0)), min_tokens=4, logprobs=2)
    structured = protocol.Sampling(max_tokens=120, temperature=0.0, logprobs=1,
                                   structured=protocol.StructuredOutput("json_schema", json.dumps(SCHEMA)))
    for name, sampling in (("controls", controls), ("structured", structured)):
        expected = await transformers_tokens(model_dir, prompt, sampling)
        assert_same(await handoff(pair, f"pd-{name}", prompt, [], sampling), expected)
    text = compute.tokenizer.decode([t for t in expected if t not in compute.eos_token_ids], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
