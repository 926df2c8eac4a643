"""KV-aware routing end to end: mode e-p-d with three prefill workers, multi-turn
chat sessions with images through the official ``openai`` client.

Which prefill worker served a request is read from its token log's ``Finish`` spans; how much
of its prompt came from that worker's prefix cache is ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest
import redis

from shared import protocol
from shared.keys import TOPIC_PREFILL, RedisKeys
from shared.settings import Settings
from tests import procs
from tests.e2e.test_skeleton import noise_image, png_data_url

PREFIX = "kvtest"
MAX_TOKENS = 8
PARTITIONS = Settings().topic_partitions
QUESTIONS = ["What is in this picture?", "Tell me more about its colours.", "And what is at the top left?",
             "Summarise it in one line."]


@pytest.fixture(scope="module")
def kv_fleet(kafka_bootstrap, redis_url, model_dir, logs_dir):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
           "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024), "MMFLEET_REDIS_PREFIX": PREFIX,
           "MMFLEET_STAGE_REPLICAS": "prefill=3", "MMFLEET_ROUTING_POLICY": "kv", "MMFLEET_KV_BLOCK_SIZE": "16"}
    log_dir = logs_dir / "kv"
    log_dir.mkdir(exist_ok=True)
    with procs.fleet(env, log_dir) as (base, proc):
        yield base, proc


@pytest.fixture(scope="module")
def client(kv_fleet):
    return openai.OpenAI(base_url=kv_fleet[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def prefill_worker(redis_url: str, request_id: str) -> str:
    r = redis.Redis.from_url(redis_url)
    try:
        entries = r.xrange(RedisKeys(PREFIX).token_stream(request_id))
    finally:
        r.close()
    finish = protocol.decode_event(entries[-1][1][b"e"])
    assert isinstance(finish, protocol.Finish), finish
    return next(s.worker for s in finish.spans if s.stage == "prefill")


class Session:
    """One chat: an image in the first user turn, then follow-up questions on the history."""

    def __init__(self, seed: int) -> None:
        self.messages: list[dict] = []
        self.url = png_data_url(noise_image(seed, size=(112, 112)))

    def turn(self, client, redis_url: str, question: str) -> tuple[str, str, int]:
        content = question if self.messages else [{"type": "image_url", "image_url": {"url": self.url}},
                                                  {"type": "text", "text": question}]
        self.messages.append({"role": "user", "content": content})
        resp = client.chat.completions.create(model="mmfleet-demo", messages=self.messages, temperature=0,
                                              max_tokens=MAX_TOKENS)
        text = resp.choices[0].message.content
        self.messages.append({"role": "assistant", "content": text})
        return text, prefill_worker(redis_url, resp.id), resp.usage.prompt_tokens_details.cached_tokens


def test_sessions_stick_to_their_prefill_worker_and_reuse_its_prefix(client, redis_url):
    sessions = [Session(seed) for seed in (11, 12, 13, 14, 15, 16)]
    first: list[str] = []
    for s in sessions:
        _text, worker, cached = s.turn(client, redis_url, QUESTIONS[0])
        assert cached == 0, "a new image cannot hit any cache"
        first.append(worker)
    assert len(set(first)) >= 2, f"with no information, load is spread: {first}"
    for q in QUESTIONS[1:]:
        for s, home in zip(sessions, first, strict=True):
            _text, worker, cached = s.turn(client, redis_url, q)
            assert worker == home, "a later turn lands on the worker holding the session's KV"
            assert cached >= 16, "and reuses at least the image's blocks"


def test_same_prompt_twice_gives_the_same_output_with_and_without_reuse(client, redis_url):
    a, b = Session(21), Session(21)
    text_a, worker_a, cached_a = a.turn(client, redis_url, QUESTIONS[0])
    text_b, worker_b, cached_b = b.turn(client, redis_url, QUESTIONS[0])
    assert cached_a == 0 and cached_b > 0 and worker_a == worker_b
    assert text_a == text_b


def test_killing_the_sessions_worker_moves_the_session_and_it_completes(client, redis_url, kv_fleet):
    s = Session(31)
    _t, home, _c = s.turn(client, redis_url, QUESTIONS[0])
    _t, again, cached = s.turn(client, redis_url, QUESTIONS[1])
    assert again == home and cached > 0
    pid = int(home.split("-")[-2])  # worker ids are stages-host-pid-nonce
    assert pid in procs.children_of(kv_fleet[1].pid)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    text, moved, _cached = s.turn(client, redis_url, QUESTIONS[2])
    assert text and moved != home, "the session went to a live worker"
    print(f"\nafter the kill the next turn finished in {time.monotonic() - t0:.1f} s on {moved}")
    _wait_for_settled_owners(redis_url, workers=3)  # the killed worker is back; its rebalance is over
    text, after, cached = s.turn(client, redis_url, QUESTIONS[3])
    assert text, "and the session goes on"
    # Whether it sticks to its new worker depends on the rebalances the restarted worker causes
    # (a moved partition loses the hit, by design): reported, not asserted.
    print(f"next turn on {after} ({'the same' if after == moved else 'another'} worker), {cached} cached tokens")


def _wait_for_settled_owners(redis_url: str, workers: int, timeout_s: float = 120) -> None:
    """Until ``workers`` prefill workers each own partitions of mm.prefill and every partition
    has an owner that lists it itself (a rebalance in progress may route a turn elsewhere:
    only the hit would be lost, which this test is not about)."""
    keys = RedisKeys(PREFIX)
    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            owners = {int(p): w.decode() for p, w in r.hgetall(keys.kv_owners(TOPIC_PREFILL)).items()}
            confirmed = {p for p, w in owners.items()
                         if str(p) in (r.hget(keys.kv_load(w), "partitions") or b"").decode().split(",")}
            if len(set(owners.values())) == workers and confirmed == set(range(PARTITIONS)):
                return
            time.sleep(0.5)
    finally:
        r.close()
    raise AssertionError(f"prefill partitions not settled over {workers} workers within {timeout_s} s")
