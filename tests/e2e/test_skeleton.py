"""The walking skeleton, end to end: real broker, real Redis, real NIXL, four worker processes
(``m-e-p-d``: every stage apart, so every topic and every hop's NIXL transfer is exercised) and
the gateway (started by the same ``mmfleet up`` the quickstart uses), driven by the official
``openai`` client. The reference is the same model's ``generate()`` in this process."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import openai
import pytest
from aiohttp import web
from PIL import Image

from services.stages import STAGE_TOPICS
from shared import protocol
from shared.models.reference import reference_generate
from tests import procs

MAX_TOKENS = 12
ADMISSION_BOUND = 6


def png_data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def noise_image(seed: int, size=(96, 80)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def gradient_image(size=(112, 84)) -> Image.Image:
    x = np.linspace(0, 255, size[0], dtype=np.uint8)
    arr = np.stack([np.tile(x, (size[1], 1)), np.tile(x[::-1], (size[1], 1)),
                    np.full((size[1], size[0]), 90, np.uint8)], axis=-1)
    return Image.fromarray(arr)


@pytest.fixture(scope="module")
def media_server():
    """A local HTTP server for image URLs (the fleet allowlists 127.0.0.1 for it)."""
    images = {"/gradient.png": gradient_image(), "/noise7.png": noise_image(7)}
    loop = asyncio.new_event_loop()
    app = web.Application()

    async def serve(request: web.Request) -> web.Response:
        img = images.get(request.path)
        if img is None:
            return web.Response(status=404)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return web.Response(body=buf.getvalue(), content_type="image/png")

    app.router.add_get("/{name}", serve)
    runner = web.AppRunner(app)
    port = procs.free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", images
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, redis_url, model_dir, logs_dir, media_server):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
           "MMFLEET_MEDIA_ALLOW_HOSTS": "127.0.0.1", "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024),
           "MMFLEET_MAX_INFLIGHT_REQUESTS": str(ADMISSION_BOUND)}
    with procs.fleet(env, logs_dir, mode="m-e-p-d") as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=fleet + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, content, **kw):
    return client.chat.completions.create(model="mmfleet-demo", messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=MAX_TOKENS, **kw)


def streamed(client, content) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in chat(client, content, stream=True):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def reference_text(model_dir, content_parts, images, max_tokens: int = MAX_TOKENS) -> str:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": content_parts}]
    ids = reference_generate(model_dir, messages, images, max_tokens)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.decode(ids, skip_special_tokens=True)


def image_parts(urls: list[str], text: str) -> list[dict]:
    return [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": text}]


def ref_parts(n: int, text: str) -> list[dict]:
    return [*({"type": "image"} for _ in range(n)), {"type": "text", "text": text}]


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_stream_whole_and_reference_agree(client, model_dir, n_images):
    images = [noise_image(1), gradient_image()][:n_images]
    text = "Describe what you see." if n_images else "Tell me a story about the sea."
    content = image_parts([png_data_url(i) for i in images], text) if n_images else text
    whole = chat(client, content)
    stream_text, stream_finish = streamed(client, content)
    expected = reference_text(model_dir, ref_parts(n_images, text) if n_images else text, images)
    assert whole.choices[0].message.content == expected
    assert stream_text == expected
    assert whole.choices[0].finish_reason == stream_finish
    assert whole.usage.completion_tokens >= 1
    assert whole.usage.prompt_tokens > (n_images * 4)


def test_concurrent_requests_each_get_their_reference(client, model_dir):
    """Requests generating at once share batched decode forwards (and ring each other's hops):
    each still gets exactly its own ``generate()`` tokens."""
    from concurrent.futures import ThreadPoolExecutor

    images = [noise_image(1), gradient_image(), noise_image(5)]
    cases = [([], "Tell me a story about the sea."), (images[:1], "Describe what you see."),
             (images[:2], "Compare the two pictures."), (images[2:], "What colour dominates?")]

    def ask(case):
        imgs, text = case
        return chat(client, image_parts([png_data_url(i) for i in imgs], text) if imgs else text)

    with ThreadPoolExecutor(len(cases)) as pool:
        got = [r.choices[0].message.content for r in pool.map(ask, cases)]
    assert got == [reference_text(model_dir, ref_parts(len(imgs), text) if imgs else text, imgs)
                   for imgs, text in cases]


def test_different_image_gives_different_answer(client):
    a = chat(client, image_parts([png_data_url(noise_image(1))], "What is this?")).choices[0].message.content
    b = chat(client, image_parts([png_data_url(gradient_image())], "What is this?")).choices[0].message.content
    assert a != b


def test_http_image_url_matches_data_url(client, media_server):
    base, images = media_server
    by_url = chat(client, image_parts([base + "/gradient.png"], "What is this?")).choices[0].message.content
    inline = chat(client, image_parts([png_data_url(images["/gradient.png"])], "What is this?"))
    assert by_url == inline.choices[0].message.content


BAD_IMAGES = {
    "bad base64": "data:image/png;base64,!!!not-base64!!!",
    "not an image": "data:image/png;base64," + base64.b64encode(b"hello, I am plain text").decode(),
    "unsupported mime": "data:text/plain;base64," + base64.b64encode(b"hello").decode(),
    "gif not accepted": "data:image/gif;base64," + base64.b64encode(b"GIF89a....").decode(),
    "truncated png": png_data_url(noise_image(3))[:200],
    "unknown scheme": "ftp://example.com/a.png",
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_image_is_a_400_and_fleet_keeps_serving(client, case):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, image_parts([BAD_IMAGES[case]], "What is this?"))
    body = info.value.body
    assert body["message"] and body["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in body["message"]
    # the same client still gets served
    assert chat(client, "Still there?").choices[0].message.content is not None


def test_bad_image_while_streaming_is_a_400(client):
    with pytest.raises(openai.BadRequestError):
        for _ in chat(client, image_parts([BAD_IMAGES["not an image"]], "What is this?"), stream=True):
            pass


def test_models_and_health(client, fleet):
    import urllib.request

    assert [m.id for m in client.models.list().data] == ["mmfleet-demo"]
    for path in ("/health", "/ready"):
        with urllib.request.urlopen(fleet + path, timeout=5) as resp:
            assert resp.status == 200


def test_seeded_sampling_controls_draw_what_epd_draws(client, model_dir):
    """The seeded request test_api_conformance sends to an EPD fleet gives, in e-p-d (prefill
    samples the first token, decode the rest), the same in-process engine's tokens."""
    from tests.e2e.test_api_conformance import MODEL, MSGS, SEEDED, expected_logprobs, expected_text, seeded_body

    got = client.chat.completions.create(model=MODEL, messages=MSGS, **SEEDED).choices[0]
    assert got.message.content == expected_text(model_dir, seeded_body())[0]
    # logprobs: the first token's travels from prefill to decode in the DecodeRequest
    with_lp = client.chat.completions.create(model=MODEL, messages=MSGS, logprobs=True, top_logprobs=2,
                                             **SEEDED).choices[0]
    want = expected_logprobs(model_dir, {**seeded_body(), "logprobs": True, "top_logprobs": 2})
    assert with_lp.message.content == got.message.content
    assert [e.logprob for e in with_lp.logprobs.content] == pytest.approx([w.logprob for w in want], abs=1e-3)
    assert [len(e.top_logprobs) for e in with_lp.logprobs.content] == [2] * len(want)


def test_structured_output_and_tool_calls_in_e_p_d(client, model_dir):
    """response_format and forced tool calls: decode continues the grammar after prefill's first token."""
    from tests.e2e.test_api_conformance import check_structured_output, check_tool_calls

    check_structured_output(client, model_dir)
    check_tool_calls(client)  # forced calls: the same grammar across the split


def test_unknown_model_and_bad_params(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="mmfleet-demo", messages=[{"role": "user", "content": "hi"}],
                                       temperature=5)


def test_no_message_on_any_topic_exceeds_a_few_kib(client, kafka_bootstrap):
    """After a big image went through, every record on every stage topic is small."""
    big = noise_image(11, size=(1024, 1024))  # ~3 MiB of PNG
    chat(client, image_parts([png_data_url(big)], "What is this?"))
    sizes = asyncio.run(_record_sizes(kafka_bootstrap))
    assert sum(len(v) for v in sizes.values()) > 0
    # records carry descriptors, not tensors: ~0.5 KiB per NIXL owner (AgentRef) and ~0.2 KiB
    # per item, so a two-image request's record is ~4 KiB here (the names inside grow with pid
    # and port digits); the big image's pixels alone are 1.2 MiB
    for topic, values in sizes.items():
        assert max(values, default=0) <= 8192, f"{topic}: a record of {max(values)} bytes"
    assert sizes["mm.media-fetch"] and sizes["mm.encode"] and sizes["mm.prefill"] and sizes["mm.decode"]


async def _record_sizes(bootstrap: str) -> dict[str, list[int]]:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(*STAGE_TOPICS, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False, fetch_max_wait_ms=50)
    await consumer.start()
    sizes: dict[str, list[int]] = {t: [] for t in STAGE_TOPICS}
    try:
        idle = 0
        while idle < 3:
            batch = await consumer.getmany(timeout_ms=300)
            idle = idle + 1 if not batch else 0
            for tp, records in batch.items():
                for rec in records:
                    protocol.decoder_for(_union(tp.topic)).decode(rec.value)  # every record decodes
                    sizes[tp.topic].append(len(rec.value) + len(rec.key or b""))
    finally:
        await consumer.stop()
    return sizes


def _union(topic: str):
    from services.stages import SPECS

    return next(s.message for s in SPECS if s.topic == topic)


def test_readme_curl_example_works(fleet):
    """The README's first curl command, as written, against this fleet's port."""
    import json
    import re
    import subprocess

    readme = (procs.REPO / "README.md").read_text()
    block = re.search(r"```sh\n(curl .*?)\n```", readme, re.S).group(1)
    command = block.replace("http://127.0.0.1:8000", fleet)
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=True).stdout
    body = json.loads(out)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] > 0


def test_finish_event_records_the_path_through_every_stage(client, redis_url):
    """The token log's terminal event names each stage the request went through, with times."""
    import redis

    resp = chat(client, image_parts([png_data_url(noise_image(4))], "What is this?"))
    r = redis.Redis.from_url(redis_url)
    try:
        entries = r.xrange(f"mm:stream:{resp.id}")
    finally:
        r.close()
    finish = protocol.decode_event(entries[-1][1][b"e"])
    assert isinstance(finish, protocol.Finish)
    assert [s.stage for s in finish.spans] == ["media-fetch", "encode", "prefill", "decode"]
    for span in finish.spans:
        assert span.total_ms > 0 and span.queue_ms >= 0 and 0 <= span.transfer_ms <= span.total_ms
    assert all(s.transfer_ms > 0 for s in finish.spans)  # each stage moved a tensor over NIXL
    # the TTFT split's stamps (loadtest/ttft_split.py): claims timed, wall-clock starts in
    # pipeline order, and prefill says when it wrote the first token (decode resumed after it)
    assert all(s.claim_ms > 0 for s in finish.spans)
    starts = [s.start_unix_ms for s in finish.spans]
    assert starts == sorted(starts) and starts[0] > 0
    assert [s.first_out_ms > 0 for s in finish.spans] == [False, False, True, False]
    assert finish.spans[2].first_out_ms <= finish.spans[2].total_ms


def test_admission_at_twice_the_bound_gives_429_with_retry_after(fleet):
    """2x the gateway's in-flight bound at once: the excess is refused with 429 + Retry-After,
    everything admitted completes."""
    async def run():
        client = openai.AsyncOpenAI(base_url=fleet + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one():
            try:
                stream = await client.chat.completions.create(
                    model="mmfleet-demo", stream=True, temperature=0, max_tokens=48,
                    messages=[{"role": "user", "content": "Tell me a long story."}])
                return "ok", "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            except openai.RateLimitError as exc:
                return "429", exc.response.headers.get("retry-after")

        try:
            return await asyncio.gather(*(one() for _ in range(2 * ADMISSION_BOUND)))
        finally:
            await client.close()

    results = asyncio.run(run())
    kinds = [k for k, _ in results]
    assert kinds.count("429") >= 1 and kinds.count("ok") >= ADMISSION_BOUND // 2, kinds
    assert all(v == "1" for k, v in results if k == "429")
    texts = {v for k, v in results if k == "ok"}
    assert len(texts) == 1  # the admitted ones all completed with the same (greedy) answer


def test_video_matches_reference_generate(client, model_dir):
    """A video_url (an mp4 made here with PyAV) through media-fetch → encode → prefill → decode:
    at temperature 0 the fleet's text equals generate() on the same sampled frames; asking for
    a different number of frames is a different input."""
    from shared.media.video import VideoLimits, decode_video
    from shared.settings import Settings
    from tests.media import samples

    s = Settings()
    limits = VideoLimits(s.max_video_duration_s, s.max_video_frames, s.max_video_side, s.max_video_decoded_frames)
    raw = samples.video(samples.video_frames(16, size=(96, 64), seed=4), fps=8)
    url = "data:video/mp4;base64," + base64.b64encode(raw).decode()
    text = "What happens in this video?"
    answers = {}
    for num_frames in (4, 6):
        content = [{"type": "video_url", "video_url": {"url": url, "num_frames": num_frames}},
                   {"type": "text", "text": text}]
        frames = decode_video(raw, num_frames=num_frames, fps=0, limits=limits, param="p")
        from transformers import AutoTokenizer

        ids = reference_generate(model_dir, [{"role": "user", "content": [{"type": "video"},
                                                                           {"type": "text", "text": text}]}],
                                 [], MAX_TOKENS, videos=[frames])
        expected = AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)
        whole = chat(client, content)
        assert whole.choices[0].message.content == expected
        assert streamed(client, content)[0] == expected
        answers[num_frames] = expected
    assert answers[4] != answers[6]


def test_precomputed_embeds_answer_like_their_media(client, model_dir):
    """What a vLLM client sends (the model's own encoder output for an image / a video as a
    base64 torch.save tensor, Qwen's dict form with the grid) and mmfleet's .npy form skip the
    encoder and get exactly the answer the media itself gets; hostile payloads are 400s."""
    import torch

    from shared.engines.qwen2_vl import Qwen2VLCompute
    from shared.media.video import VideoLimits, decode_video
    from shared.settings import Settings
    from tests.media import samples
    from tests.media.embeds_blobs import b64, callable_pickle_blob, npy, torch_blob, zip_bomb_blob

    compute = Qwen2VLCompute(model_dir)
    img = noise_image(11)
    px = compute.preprocess_image(img)
    (emb,) = compute.encode_media([px])
    ask = {"type": "text", "text": "What is this?"}
    by_image = chat(client, image_parts([png_data_url(img)], "What is this?")).choices[0].message.content
    for form in ({"data": b64(npy(emb.numpy())), "format": "npy", "grid_thw": list(px.grid_thw)},
                 {"image_embeds": b64(torch_blob(emb)), "image_grid_thw": b64(torch_blob(torch.tensor(px.grid_thw)))}):
        assert chat(client, [{"type": "image_embeds", "image_embeds": form}, ask]).choices[0].message.content \
            == by_image
    s = Settings()
    raw = samples.video(samples.video_frames(16, size=(96, 64), seed=4), fps=8)
    frames = decode_video(raw, num_frames=4, fps=0, limits=VideoLimits(s.max_video_duration_s, s.max_video_frames,
                                                                       s.max_video_side, s.max_video_decoded_frames),
                          param="p")
    vpx = compute.preprocess_video(frames)
    (vemb,) = compute.encode_media([vpx])
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(raw), "num_frames": 4}}
    by_video = chat(client, [video, ask]).choices[0].message.content
    part = {"type": "video_embeds", "video_embeds": {"video_embeds": b64(torch_blob(vemb)),
                                                     "video_grid_thw": [list(vpx.grid_thw)]}}
    assert chat(client, [part, ask]).choices[0].message.content == by_video
    grid = list(px.grid_thw)
    for payload, fragment in ((npy(np.zeros((px.n_tokens, 64), np.float32)), "its hidden size is 128"),
                              (callable_pickle_blob(), "weights_only"), (zip_bomb_blob(), "is compressed"),
                              (torch_blob(emb.double()), "got dtype float64")):
        bad = {"type": "image_embeds", "image_embeds": {"image_embeds": b64(payload), "image_grid_thw": grid}}
        with pytest.raises(openai.BadRequestError, match=fragment) as info:
            chat(client, [bad, ask])
        assert info.value.body["param"] == "messages[0].content[0]"
