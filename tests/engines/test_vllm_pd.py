"""vLLM prefill and decode apart: a kv_producer engine prefills, a kv_consumer engine reads
the KV over NIXL (vLLM's NixlConnector, CPU buffers) and decodes. Greedy tokens must equal
one-process ``generate()``; the consumer never sees the images (zero placeholders), so equal
tokens mean the KV really moved. Two engines for the module (~30-60 s of start-up here).
The producer's prefix cache reports to the routing table through vLLM's KV events (last test).
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest

pytest.importorskip("vllm")

from services.prefill.handler import PrefillHandler  # noqa: E402
from shared import protocol  # noqa: E402
from shared.engines import vllm_pd  # noqa: E402
from shared.engines.transformers_engine import TransformersEngine  # noqa: E402
from shared.engines.vllm_engine import VllmEngine  # noqa: E402
from shared.keys import TOPIC_DECODE, TOPIC_PREFILL, RedisKeys  # noqa: E402
from shared.kv.prefix_cache import PrefixCache  # noqa: E402
from shared.kv.reuse import EngineCacheReport, PrefixReuse  # noqa: E402
from shared.kv.router import Router  # noqa: E402
from shared.kv.table import LoadReporter, LoadTracker, TableWriter  # noqa: E402
from shared.models.registry import placeholder_token_id  # noqa: E402
from shared.settings import Settings  # noqa: E402
from shared.stage import Context  # noqa: E402
from shared.transfer import OwnerGoneError  # noqa: E402
from tests.engines.test_vllm_engine import CASES, GREEDY, cases, collect, compute, reference  # noqa: E402,F401
from tests.fakes import ListSink, MemoryTransfer  # noqa: E402


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


# ---------------------------------------------------------------- vLLM's prefix cache → routing table
KV_WORKER = "prefill-vllm-test"


def kv_request(compute, rid: str, img, mm_hash: str, enc: MemoryTransfer) -> protocol.PrefillRequest:  # noqa: F811 (fixture name)
    """Text before and after one image (blocks of text only, of the image, of text after it),
    the image's embeddings held by an 'encode' agent as the encode stage would."""
    text = " ".join(["the quick brown fox jumps over a lazy dog"] * 6)
    messages = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"},
                                             {"type": "text", "text": text}]}]
    px = compute.preprocess_image(img)
    (emb,) = compute.encode_media([px])
    meta = protocol.RequestMeta(request_id=rid, model="m", deadline_unix_ms=0, created_unix_ms=0,
                                prompt_token_ids=tuple(compute.render_prompt_ids(messages)),
                                sampling=protocol.Sampling(max_tokens=4, temperature=0.0))
    item = protocol.EmbeddingItem(0, mm_hash, px.grid_thw, px.n_tokens, enc.put(emb))
    return protocol.PrefillRequest(meta=meta, items=(item,), owners=(enc.ref(),))


class ChangeLog:
    """Stands in for the routing table's writer: the cache changes a prefill handler reports."""

    def __init__(self) -> None:
        self.changes = []

    def changed(self, changes) -> None:
        self.changes.append(changes)


async def prefill_and_read(handler, consumer, msg, ctx, log: ChangeLog):
    """The prefill handler's outcome → (its DecodeRequest, its cache's changes or None); the
    consumer then reads the KV (which frees the producer's blocks, as decode does in a fleet)."""
    before = len(log.changes)
    outcome = await handler.handle(msg, ctx)
    by_topic = {p.topic: p.value for p in outcome.produce}
    decode = by_topic[TOPIC_DECODE]
    if decode.engine_kv is not None:
        await collect(consumer.decode_remote(msg.meta.request_id, list(msg.meta.prompt_token_ids), decode.engine_kv,
                                             decode.first_token, msg.meta.sampling))
    changed = [c for c in log.changes[before:] if c]
    assert len(changed) <= 1, changed
    return decode, (changed[0] if changed else None)


async def test_prefill_kv_events_land_in_the_routing_table_with_the_transformers_keys(
        pair, compute, model_dir, redis_url):  # noqa: F811 (fixture)
    """A vLLM prefill worker's prefix cache, through vLLM's KV events, lists in the routing table
    exactly the block keys the transformers path's prefix cache stores for the same request
    (mm_hash included), as far as vLLM's whole blocks go; the router then picks that worker; the
    same prompt again hits vLLM's cache (cached_tokens) and adds no keys; another image behind
    the same tokens adds only the keys from its image block on."""
    import numpy as np
    from aiokafka import TopicPartition
    from PIL import Image
    from redis import asyncio as aioredis

    producer, consumer = pair
    placeholder = placeholder_token_id(model_dir)
    ours = producer.kv_block_size
    world: dict = {}
    enc = MemoryTransfer("encode", world)
    ctx = Context(stage="prefill", worker_id=KV_WORKER, events=ListSink(), transfer=MemoryTransfer("prefill", world))
    log = ChangeLog()
    handler = PrefillHandler(producer, engine_cache=EngineCacheReport(placeholder, ours), table=log)
    rng = np.random.default_rng(5)
    img_a, img_b = (Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(2))

    msg_a = kv_request(compute, "kv-a", img_a, "mm-a", enc)
    decode_a, ev_a = await prefill_and_read(handler, consumer, msg_a, ctx, log)
    whole = decode_a.prompt_len // producer.block_size * (producer.block_size // ours)  # our keys vLLM can hold
    assert whole >= 4 and ev_a is not None

    # the transformers path on the same request: its prefix cache's stored keys
    tf = TransformersEngine(model_dir)
    await tf.start()
    try:
        tf_log = ChangeLog()
        tf_handler = PrefillHandler(tf, PrefixReuse(PrefixCache(1 << 26, ours), placeholder), table=tf_log)
        tf_ctx = Context(stage="prefill", worker_id="prefill-tf", events=ListSink(),
                         transfer=MemoryTransfer("prefill-tf", world))
        await tf_handler.handle(kv_request(compute, "kv-a-tf", img_a, "mm-a", enc), tf_ctx)
    finally:
        await tf.stop()
    (tf_ev,) = tf_log.changes
    assert list(ev_a.stored) == list(tf_ev.stored[:whole]) and not ev_a.removed

    # into the routing table (the worker's table writer) and routed on
    settings = Settings(redis_url=redis_url, redis_prefix=f"vkv{uuid.uuid4().hex[:8]}", kv_block_size=ours)
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys(settings.redis_prefix)
    try:
        reporter = LoadReporter(redis, keys, KV_WORKER, LoadTracker(), settings)
        await reporter.on_partitions_assigned([TopicPartition(TOPIC_PREFILL, 0)])
        other = LoadReporter(redis, keys, "prefill-other", LoadTracker(), settings)
        await other.on_partitions_assigned([TopicPartition(TOPIC_PREFILL, 1)])
        writer = TableWriter(redis, keys, KV_WORKER, settings)
        writing = asyncio.create_task(writer.run())
        writer.changed(ev_a)
        assert await writer.flush()
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
        held = {int(x) for x in await redis.smembers(keys.kv_blocks(KV_WORKER))}
        assert held == set(tf_ev.stored[:whole])
        decision = await Router(redis, keys, settings, placeholder).decide(kv_request(compute, "kv-a2", img_a,
                                                                                       "mm-a", enc))
        assert (decision.worker_id, decision.overlap, decision.partition) == (KV_WORKER, whole, 0)
    finally:
        await redis.aclose()

    # the same prompt again: vLLM's own prefix cache serves it, nothing new to list
    decode_again, ev_again = await prefill_and_read(handler, consumer, kv_request(compute, "kv-a3", img_a, "mm-a",
                                                                                  enc), ctx, log)
    assert decode_again.cached_tokens >= (whole // (producer.block_size // ours) - 1) * producer.block_size > 0
    assert ev_again is None or not ev_again.stored
    assert decode_again.first_token == decode_a.first_token

    # another image behind the same tokens: new keys from the image's block on, text before shared
    msg_b = kv_request(compute, "kv-b", img_b, "mm-b", enc)
    _decode_b, ev_b = await prefill_and_read(handler, consumer, msg_b, ctx, log)
    keys_b = EngineCacheReport(placeholder, ours).hashes(msg_b)[:whole]
    keys_a = set(tf_ev.stored[:whole])
    assert ev_b is not None and set(ev_b.stored) == set(keys_b) - keys_a
    assert 0 < len(ev_b.stored) < whole and keys_b[0] in keys_a


def test_the_connector_agent_runs_without_a_progress_thread():
    """NIXL's progress thread spins a core per agent (shared/engines/vllm_connector.py): the
    fleet's connector module turns it off in the config vLLM's worker builds its agent from."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    import shared.engines.vllm_connector  # noqa: F401 - importing it patches the config

    config = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
    assert config.enable_pthread is False
    assert config.num_threads == 4  # the rest as vLLM asked
