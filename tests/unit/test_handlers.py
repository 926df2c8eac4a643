"""Stage handlers with in-memory ports (transfer, event sink) and the real tiny model: the
request path media-fetch → encode → prefill → decode as plain function calls."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import msgspec
import numpy as np
import pytest
from PIL import Image

from services.decode.handler import DecodeHandler
from services.encode.handler import EncodeHandler
from services.media_fetch.handler import MediaFetchHandler
from services.prefill.generate import GenerateHandler
from services.prefill.handler import PrefillHandler
from shared import protocol
from shared.engines.qwen2_vl import ImagePreprocessor
from shared.engines.transformers_engine import TransformersEngine
from shared.keys import TOPIC_DECODE, TOPIC_ENCODE, TOPIC_PREFILL, RedisKeys
from shared.kv.router import Router
from shared.media.fetch import MediaFetcher
from shared.models.reference import reference_generate
from shared.process.compute import ComputeLane
from shared.settings import Settings
from shared.stage import Context, RequestFailed
from tests.fakes import ListSink, MemoryTransfer


def _png(seed: int, size=(80, 64)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
async def engine(model_dir):
    eng = TransformersEngine(model_dir, encode_max_batch_items=8, encode_batch_wait_ms=20)
    await eng.start()
    yield eng
    await eng.stop()


@pytest.fixture
def compute(engine):
    return engine.compute


@pytest.fixture(params=["split", "merged"])
async def pipeline(request, model_dir, engine):
    """"split": prefill and decode apart (KV through the pool); "merged": one generate()."""
    settings = Settings()
    lane = ComputeLane("test")
    world: dict = {}
    sink = ListSink()

    def ctx(name: str) -> Context:
        return Context(stage=name, worker_id=name, events=sink, transfer=MemoryTransfer(name, world))

    prefill = PrefillHandler(engine) if request.param == "split" else GenerateHandler(engine)
    async with MediaFetcher(allow_hosts=(), timeout_ms=2000) as fetcher:
        yield {
            "settings": settings, "sink": sink, "engine": engine, "gateway": ctx("gateway"),
            "stages": {
                "media-fetch": (MediaFetchHandler(settings, fetcher, ImagePreprocessor(model_dir), lane),
                                ctx("media-fetch")),
                "encode": (EncodeHandler(engine), ctx("encode")),
                "prefill": (prefill, ctx("prefill")),
                "decode": (DecodeHandler(engine), ctx("decode")),
            },
        }
    lane.close()


def _meta(request_id: str, prompt_ids, max_tokens=12, **sampling) -> protocol.RequestMeta:
    now = int(time.time() * 1000)
    return protocol.RequestMeta(request_id=request_id, model="m", created_unix_ms=now,
                                deadline_unix_ms=now + 60_000, prompt_token_ids=tuple(prompt_ids),
                                sampling=protocol.Sampling(max_tokens=max_tokens, temperature=0.0, **sampling))


async def _run(p, msg) -> None:
    """Drive a message through the stages the way the runners would, releases included."""
    topic_stage = {TOPIC_ENCODE: "encode", TOPIC_PREFILL: "prefill", TOPIC_DECODE: "decode"}
    stage = "media-fetch" if isinstance(msg, protocol.MediaFetchRequest) else "prefill"
    while True:
        handler, ctx = p["stages"][stage]
        outcome = await handler.handle(msg, ctx)
        for owner, leases in outcome.releases:
            await ctx.transfer.release(owner, leases)
        if not outcome.produce:
            return
        (out,) = outcome.produce
        stage, msg = topic_stage[out.topic], out.value


def _inline(p, raws: list[bytes]) -> protocol.MediaFetchRequest:
    gw = p["gateway"].transfer
    import torch

    items = tuple(protocol.MediaSource(kind="image", param=f"messages[0].content[{i}]", mime="image/png",
                                       inline=gw.put(torch.frombuffer(bytearray(r), dtype=torch.uint8)))
                  for i, r in enumerate(raws))
    return items


@pytest.mark.parametrize("n_images", [0, 1, 2])
async def test_handlers_match_generate(pipeline, compute, model_dir, n_images):
    raws = [_png(1), _png(2, (128, 96))][:n_images]
    parts = [*({"type": "image"} for _ in raws), {"type": "text", "text": "What is shown here?"}]
    messages = [{"role": "user", "content": parts}]
    prompt_ids = compute.render_prompt_ids(messages)
    rid = f"r{n_images}"
    if raws:
        msg = protocol.MediaFetchRequest(meta=_meta(rid, prompt_ids), items=_inline(pipeline, raws),
                                         owner=pipeline["gateway"].transfer.ref())
    else:
        msg = protocol.PrefillRequest(meta=_meta(rid, prompt_ids))
    await _run(pipeline, msg)

    images = [Image.open(io.BytesIO(r)).convert("RGB") for r in raws]
    expected = reference_generate(model_dir, messages, images, 12)
    events = pipeline["sink"].events[rid]
    tokens = [t for e in events if isinstance(e, protocol.TokenDelta) for t in e.token_ids]
    assert tokens == [t for t in expected if t not in compute.eos_token_ids]
    assert pipeline["sink"].text(rid) == compute.tokenizer.decode(expected, skip_special_tokens=True)
    assert isinstance(events[-1], protocol.Finish)
    # every stage's pool slot was released along the way: nothing pinned until TTL; the
    # gateway's inline bytes stay until the request ends (a restart may read them again)
    for name in ("media-fetch", "encode", "prefill"):
        assert pipeline["stages"][name][1].transfer.slots == {}, name
    assert len(pipeline["gateway"].transfer.slots) == n_images


async def test_concurrent_requests_share_one_encoder_forward(pipeline, compute):
    prompt_ids = compute.render_prompt_ids([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                            "text": "hi"}]}])
    reqs = [protocol.MediaFetchRequest(meta=_meta(f"c{i}", prompt_ids, max_tokens=2),
                                       items=_inline(pipeline, [_png(10 + i)]),
                                       owner=pipeline["gateway"].transfer.ref()) for i in range(4)]
    await asyncio.gather(*(_run(pipeline, r) for r in reqs))
    batches, items = pipeline["engine"].encode_stats
    assert items == 4
    assert batches < 4  # items of different messages met in one forward


@pytest.mark.parametrize("payload", [b"not an image at all", _png(5)[:100]])
async def test_bad_media_fails_the_request_and_leaves_no_slot(pipeline, compute, payload):
    handler, ctx = pipeline["stages"]["media-fetch"]
    msg = protocol.MediaFetchRequest(meta=_meta("bad", [1, 2]), items=_inline(pipeline, [payload]),
                                     owner=pipeline["gateway"].transfer.ref())
    with pytest.raises(RequestFailed) as info:
        await handler.handle(msg, ctx)
    assert info.value.event.status == 400
    assert info.value.event.param == "messages[0].content[0]"
    assert ctx.transfer.slots == {}  # media-fetch freed what it had put; the gateway frees its own


async def test_stop_string_and_max_tokens(pipeline, compute):
    prompt_ids = compute.render_prompt_ids([{"role": "user", "content": "Tell me about the sea."}])
    await _run(pipeline, protocol.PrefillRequest(meta=_meta("full", prompt_ids, max_tokens=10)))
    full = pipeline["sink"].text("full")
    assert pipeline["sink"].events["full"][-1].reason == "length"
    cut = full[3:5] if len(full) > 5 else full[-1:]
    await _run(pipeline, protocol.PrefillRequest(meta=_meta("cut", prompt_ids, max_tokens=10, stop=(cut,))))
    assert pipeline["sink"].text("cut") == full[: full.index(cut)]
    assert pipeline["sink"].events["cut"][-1].reason == "stop"


async def test_first_text_held_back_is_written_by_prefill(pipeline, compute):
    """A stop string the first tokens' text starts (never completed) holds that text back: prefill
    (split) writes deltas until one shows text, decode resumes after them; the text is the same."""
    prompt_ids = compute.render_prompt_ids([{"role": "user", "content": "Tell me about the sea."}])
    await _run(pipeline, protocol.PrefillRequest(meta=_meta("full", prompt_ids, max_tokens=10)))
    full = [e for e in pipeline["sink"].events["full"] if isinstance(e, protocol.TokenDelta)]
    held = compute.tokenizer.decode([t for e in full[:2] for t in e.token_ids])
    if not held or len(full) < 4:
        pytest.skip("the random model's first tokens show no text to hold back")
    stop = (held + "\x00zz",)  # starts like the first two tokens' text, never completes
    prefill, pctx = pipeline["stages"]["prefill"]
    meta = _meta("held", prompt_ids, max_tokens=10, stop=stop)
    if isinstance(prefill, PrefillHandler):
        out = await prefill.handle(protocol.PrefillRequest(meta=meta), pctx)
        written = pipeline["sink"].events["held"]
        assert len(written) >= 3 and not any(e.text for e in written[:2])
        decode, dctx = pipeline["stages"]["decode"]
        for owner, leases in (await decode.handle(out.produce[0].value, dctx)).releases:
            await dctx.transfer.release(owner, leases)
    else:
        await _run(pipeline, protocol.PrefillRequest(meta=meta))
    assert pipeline["sink"].text("held") == pipeline["sink"].text("full")
    assert [e.token_ids for e in pipeline["sink"].events["held"] if isinstance(e, protocol.TokenDelta)] == \
        [e.token_ids for e in full]


async def test_seeded_sampling_is_reproducible(pipeline, compute):
    prompt_ids = compute.render_prompt_ids([{"role": "user", "content": "Sing."}])
    for rid in ("s1", "s2"):
        meta = _meta(rid, prompt_ids, max_tokens=8)
        meta = protocol.RequestMeta(**{f: getattr(meta, f) for f in meta.__struct_fields__ if f != "sampling"},
                                    sampling=protocol.Sampling(max_tokens=8, temperature=1.0, seed=42))
        await _run(pipeline, protocol.PrefillRequest(meta=meta))
    assert pipeline["sink"].text("s1") == pipeline["sink"].text("s2")


def test_data_url_roundtrip_is_what_media_fetch_sees():
    from shared.media.sources import IMAGE_MIME_TYPES, decode_data_url

    raw = _png(3)
    mime, data = decode_data_url("data:image/png;base64," + base64.b64encode(raw).decode(),
                                 allowed_mime=IMAGE_MIME_TYPES, max_bytes=1 << 20, param="p")
    assert (mime, data) == ("image/png", raw)


class _CrashingSink(ListSink):
    """Accepts ``crash_after`` appends, then fails like a worker dying mid-stream."""

    def __init__(self, crash_after: int) -> None:
        super().__init__()
        self.crash_after = crash_after

    async def append(self, request_id, event):
        if self.crash_after <= 0:
            raise ConnectionError("worker died")
        self.crash_after -= 1
        await super().append(request_id, event)


@pytest.mark.parametrize("crash_point", ["first", "second", "middle", "before-finish"])
async def test_decode_resumes_from_the_log_without_loss_or_duplication(pipeline, compute, crash_point):
    """A decode that dies after writing some of its events, run again on the same message and
    log, leaves exactly the log an uninterrupted decode writes; a third run writes nothing."""
    prompt_ids = compute.render_prompt_ids([{"role": "user", "content": "Tell me about the sea."}])
    await _run(pipeline, protocol.PrefillRequest(meta=_meta("clean", prompt_ids, max_tokens=10)))
    clean = pipeline["sink"].events["clean"]
    crash_after = {"first": 0, "second": 1, "middle": len(clean) // 2, "before-finish": len(clean) - 1}[crash_point]

    sink = _CrashingSink(crash_after)
    prefill, pctx = pipeline["stages"]["prefill"]
    ctx = Context(stage="decode", worker_id="w2", events=sink, transfer=pctx.transfer)
    msg = protocol.PrefillRequest(meta=_meta("resumed", prompt_ids, max_tokens=10))
    if isinstance(prefill, PrefillHandler):  # split: decode apart, from a DecodeRequest
        # prefill writes the first delta (decode resumes after it): the crash point counts it
        sink.crash_after = 10**6
        handler, msg = pipeline["stages"]["decode"][0], (await prefill.handle(msg, ctx)).produce[0].value
        sink.crash_after = crash_after - len(sink.events["resumed"])
    else:  # merged: one generate() that prefills again on redelivery
        handler = prefill
    with pytest.raises(ConnectionError):
        await handler.handle(msg, ctx)
    sink.crash_after = 10**6
    await handler.handle(msg, ctx)  # the redelivery
    assert sink.events["resumed"] == clean
    await handler.handle(msg, ctx)
    assert sink.events["resumed"] == clean


async def test_two_decodes_of_one_request_write_each_token_once(pipeline, compute):
    """The same DecodeRequest handled twice at once (a redelivery racing the live worker): the
    log equals one uninterrupted decode's, whichever writer wins each position."""
    prompt_ids = compute.render_prompt_ids([{"role": "user", "content": "Tell me about the sea."}])
    await _run(pipeline, protocol.PrefillRequest(meta=_meta("solo", prompt_ids, max_tokens=12)))
    solo = pipeline["sink"].events["solo"]
    await _run_twice_at_once(pipeline, protocol.PrefillRequest(meta=_meta("twice", prompt_ids, max_tokens=12)))
    twice = pipeline["sink"].events["twice"]
    deltas = [e for e in twice if isinstance(e, protocol.TokenDelta)]
    assert [d.seq for d in deltas] == sorted({d.seq for d in deltas}), "no position written twice"
    assert [(d.seq, d.token_ids, d.text) for d in deltas] == \
        [(d.seq, d.token_ids, d.text) for d in solo if isinstance(d, protocol.TokenDelta)]
    assert sum(isinstance(e, protocol.Finish) for e in twice) == 1


async def _run_twice_at_once(p, msg: protocol.PrefillRequest) -> None:
    """Prefill once, then the stage that writes tokens twice concurrently on the same input."""
    handler, ctx = p["stages"]["prefill"]
    if isinstance(handler, GenerateHandler):  # merged prefill+decode writes the tokens itself
        await asyncio.gather(handler.handle(msg, ctx), handler.handle(msg, ctx))
        return
    outcome = await handler.handle(msg, ctx)
    (out,) = outcome.produce
    dhandler, dctx = p["stages"]["decode"]
    await asyncio.gather(dhandler.handle(out.value, dctx), dhandler.handle(out.value, dctx))


async def test_encode_passes_index_hits_on_in_prompt_order(pipeline, compute):
    """Items media-fetch found in the embedding index (``EncodeRequest.cached``) reach prefill
    untouched, in prompt order around the ones encode encoded, their owners named."""
    mf, mf_ctx = pipeline["stages"]["media-fetch"]
    enc, enc_ctx = pipeline["stages"]["encode"]
    msg = protocol.MediaFetchRequest(meta=_meta("hits", [1, 2]), items=_inline(pipeline, [_png(3)]),
                                     owner=pipeline["gateway"].transfer.ref())
    (produced,) = (await mf.handle(msg, mf_ctx)).produce
    fresh = msgspec.structs.replace(produced.value.items[0], index=1)
    peer = protocol.AgentRef(name="enc-peer", metadata=b"")
    hit = protocol.EmbeddingItem(index=0, mm_hash="h0", grid_thw=fresh.grid_thw, n_tokens=fresh.n_tokens,
                                 embeds=protocol.TensorRef(agent="enc-peer", addr=0, nbytes=4, device_id=0, lease=0,
                                                           dtype="float32", shape=(1,)),
                                 cache_key="k0", cache_gen=5)
    later = msgspec.structs.replace(hit, index=2)
    req = msgspec.structs.replace(produced.value, items=(fresh,), cached=(later, hit), cached_owners=(peer,))
    outcome = await enc.handle(req, enc_ctx)
    (out,) = outcome.produce
    assert [it.index for it in out.value.items] == [0, 1, 2]
    assert out.value.items[0] == hit and out.value.items[2] == later
    assert {o.name for o in out.value.owners} == {"enc-peer", "encode"}
    for owner, leases in outcome.releases:  # media-fetch's pixels, as the runner would
        await enc_ctx.transfer.release(owner, leases)
    enc_ctx.transfer.free_local(out.value.items[1].embeds.lease)


async def test_encode_reads_the_route_ahead_for_the_blocks_it_produces(pipeline, compute):
    """encode starts the routing-table read for its PrefillRequest before the encoder runs, with
    what gives exactly that request's block hashes (its fresh and cached items), so the decision
    at the produce point uses it instead of a round trip of its own."""
    mf, mf_ctx = pipeline["stages"]["media-fetch"]
    enc, enc_ctx = pipeline["stages"]["encode"]
    ph = compute.placeholder_token_id
    prompt = [5, ph, 6, 7, ph, *range(20, 40)]
    msg = protocol.MediaFetchRequest(meta=_meta("ahead", prompt), items=_inline(pipeline, [_png(4)]),
                                     owner=pipeline["gateway"].transfer.ref())
    (produced,) = (await mf.handle(msg, mf_ctx)).produce
    fresh = msgspec.structs.replace(produced.value.items[0], index=1)
    hit = protocol.EmbeddingItem(index=0, mm_hash="h0", grid_thw=fresh.grid_thw, n_tokens=fresh.n_tokens,
                                 embeds=protocol.TensorRef(agent="enc-peer", addr=0, nbytes=4, device_id=0, lease=0,
                                                           dtype="float32", shape=(1,)), cache_key="k0")
    req = msgspec.structs.replace(produced.value, items=(fresh,), cached=(hit,),
                                  cached_owners=(protocol.AgentRef(name="enc-peer", metadata=b""),))
    seen = []

    class Recording(Router):
        def read_ahead(self, request_id, prompt_ids, items, salt=""):
            seen.append((request_id, enc_engine.encode_stats[1], self._hashes(prompt_ids, items, salt)))

    router = Recording(None, RedisKeys("t"), Settings(kv_block_size=4), ph)
    enc_engine = pipeline["engine"]
    items_before = enc_engine.encode_stats[1]
    outcome = await EncodeHandler(enc_engine, router=router).handle(req, enc_ctx)
    (out,) = outcome.produce
    want = router._hashes(out.value.meta.prompt_token_ids, out.value.items)
    assert len(want) > 3 and seen == [("ahead", items_before, want)]  # before the encoder, the same blocks
    for owner, leases in outcome.releases:
        await enc_ctx.transfer.release(owner, leases)
    enc_ctx.transfer.free_local(out.value.items[1].embeds.lease)


async def test_prefill_writes_the_first_token_before_keeping_its_prefix(engine, compute):
    """The client's first token must not wait for the prefix cache storing the prompt's blocks."""
    from shared.kv.prefix_cache import PrefixCache
    from shared.kv.reuse import PrefixReuse

    sink, seen, table = ListSink(), [], []

    class Recording(PrefixReuse):
        def keep(self, lookup, kv):
            seen.append([e for e in sink.events.get("pk", []) if isinstance(e, protocol.TokenDelta)])
            return super().keep(lookup, kv)

    class Table:  # the routing table's writer: what the cache changed
        def changed(self, changes):
            table.append(changes)

    ids = compute.render_prompt_ids([{"role": "user", "content": "Say something about prefixes, please."}])
    ctx = Context(stage="prefill", worker_id="prefill", events=sink, transfer=MemoryTransfer("prefill", {}))
    handler = PrefillHandler(engine, prefix=Recording(PrefixCache(1 << 24, 8), compute.placeholder_token_id),
                             table=Table())
    outcome = await handler.handle(protocol.PrefillRequest(meta=_meta("pk", ids), items=()), ctx)
    assert [len(deltas) for deltas in seen] == [1]  # kept once, the first delta already written
    assert [p.topic for p in outcome.produce] == ["mm.decode"]
    assert len(table) == 1 and len(table[0].stored) == len(ids) // 8  # the kept blocks, for the routing table


async def test_on_cpu_the_encoder_runs_one_item_per_forward_by_default(model_dir, compute):
    """0 (the default): one item a forward on CPU, where a batch costs the sum of its items and
    holds its first ones back; 16 on a GPU (only read here, nothing runs there)."""
    from shared.engines.transformers_engine import TransformersEngine

    assert TransformersEngine(model_dir, device="cuda:0")._batch_items == 16
    eng = TransformersEngine(model_dir)
    await eng.start()
    try:
        pixels = [compute.preprocess_image(Image.open(io.BytesIO(_png(20 + i))).convert("RGB")) for i in range(3)]
        await asyncio.gather(*(eng.encode(p.pixel_values, p.grid_thw, p.n_tokens) for p in pixels))
        assert eng.encode_stats == (3, 3)
    finally:
        await eng.stop()


async def test_an_engine_with_its_own_prefix_cache_gets_the_requests_cache_scope(pipeline, compute):
    """An engine whose prefix cache takes a per-request salt (vLLM) gets the request's cache scope
    as ``cache_salt``; one without the capability (the transformers engine: the fleet keys its
    prefix cache by the scope itself) is called as before."""
    import dataclasses

    engine, (_, ctx) = pipeline["engine"], pipeline["stages"]["prefill"]
    seen: list[dict] = []

    class Salted:  # the real engine, told it takes a salt, recording what generate is given
        capabilities = dataclasses.replace(engine.capabilities, cache_salt=True)

        def __getattr__(self, name):
            return getattr(engine, name)

        def generate(self, *args, cache_salt: str = "", **kw):
            seen.append({"cache_salt": cache_salt})
            return engine.generate(*args, **kw)

    prompt_ids = compute.render_prompt_ids([{"role": "user", "content": "Hello there."}])
    meta = msgspec.structs.replace(_meta("salted", prompt_ids, max_tokens=2), cache_scope="tenant-a")
    await GenerateHandler(Salted()).handle(protocol.PrefillRequest(meta=meta), ctx)
    assert seen == [{"cache_salt": "tenant-a"}]
    # the plain engine (no such capability) takes no such argument: it would raise TypeError
    meta = msgspec.structs.replace(meta, request_id="plain")
    await GenerateHandler(engine).handle(protocol.PrefillRequest(meta=meta), ctx)
    assert any(isinstance(e, protocol.Finish) for e in pipeline["sink"].events["plain"])


def test_vllm_prompts_carry_the_cache_salt(model_dir):
    from transformers import AutoTokenizer

    from shared.engines.vllm_inputs import PromptBuilder

    builder = PromptBuilder(model_dir, AutoTokenizer.from_pretrained(model_dir), max_items_per_prompt=4)
    assert builder.build([1, 2, 3], [], cache_salt="tenant-a") == {"prompt_token_ids": [1, 2, 3],
                                                                   "cache_salt": "tenant-a"}
    assert "cache_salt" not in builder.build([1, 2, 3], [])
