"""The Kafka way in and the keys, end to end: one fleet (``mmfleet up``) with API keys
configured, a password-protected Redis and a (unused, PLAINTEXT) Kafka SASL password set.

Requests are produced by a plain aiokafka producer (no project code) onto ``mm.requests`` and
answered on their ``reply_to`` topic exactly as the HTTP gateway answers the same body; then
``mmfleet submit`` runs 200 mixed requests from a JSONL file; the last test greps every log of
the fleet, the CLI's output and the error bodies for the secrets. (No ``/metrics`` endpoint
exists on this branch yet; that scrape joins the grep when it does.)
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from services.gateway.auth import hash_key
from shared import settings as settings_mod
from shared.keys import RedisKeys
from shared.transport.liveness import live_gateways, live_workers
from shared.transport.redis_conn import make_redis
from tests import procs
from tests.e2e.test_skeleton import noise_image, png_data_url

KEY = "sk-ingress-right-key-4242"
OTHER_KEY = "sk-ingress-other-tenant-5151"
LIMITED_KEY = "sk-ingress-limited-key-7373"
REDIS_PASSWORD = "redis-e2e-Pa55-9090"
SASL_PASSWORD = "sasl-e2e-Pa55-6060"
SECRETS = (KEY, OTHER_KEY, LIMITED_KEY, REDIS_PASSWORD, SASL_PASSWORD)
SEEN_TEXT: list[str] = []  # every CLI output and error body, grepped at the end


@pytest.fixture(scope="module")
def fleet_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("ingress-fleet-logs")


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, model_dir, fleet_logs, tmp_path_factory):
    with procs.redis_server(tmp_path_factory.mktemp("ingress-redis"), password=REDIS_PASSWORD) as redis_url:
        env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
               "MMFLEET_REDIS_PASSWORD": REDIS_PASSWORD, "MMFLEET_KAFKA_SASL_PASSWORD": SASL_PASSWORD,
               "MMFLEET_KAFKA_SASL_USERNAME": "unused", "MMFLEET_REDIS_PREFIX": "ing",
               "MMFLEET_API_KEY_HASHES": f"{hash_key(KEY)},{hash_key(OTHER_KEY)},{hash_key(LIMITED_KEY)}:2",
               "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024),
               # keys share cache hits here (tests/e2e/test_embedding_cache.py: the default, apart)
               "MMFLEET_CACHE_SHARE_ACROSS_TENANTS": "true"}
        with procs.fleet(env, fleet_logs, mode="epd") as (base, _proc):
            yield {"base": base, "bootstrap": kafka_bootstrap, "env": env}


def body(content, **kw) -> dict:
    return {"model": "mmfleet-demo", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": content}], **kw}


def image_content(url: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]


def http(base: str, payload: bytes | dict, key: str | None = KEY, path="/v1/chat/completions"):
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        text = err.read().decode()
        SEEN_TEXT.append(text)
        return err.code, text, dict(err.headers)


async def _topic(bootstrap: str, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        if name not in await admin.list_topics():
            await admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])
    finally:
        await admin.close()


async def _produce(bootstrap: str, records: list[tuple[bytes | None, bytes, list]]) -> list:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        return [await producer.send_and_wait("mm.requests", value, key=key, headers=headers)
                for key, value, headers in records]
    finally:
        await producer.stop()


async def _replies(bootstrap: str, topic: str, want: set[str], timeout_s: float = 180) -> dict[str, list]:
    """Every reply record on ``topic`` until each id in ``want`` has its terminal one:
    {request_id: [(headers dict, json body), ...]} in arrival order."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                fetch_max_wait_ms=50)
    await consumer.start()
    out: dict[str, list] = {}
    done: set[str] = set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while not want <= done:
            assert loop.time() < deadline, f"no terminal reply for {want - done}"
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    h = {k: v.decode() for k, v in r.headers}
                    rid = (r.key or b"").decode()
                    out.setdefault(rid, []).append((h, json.loads(r.value)))
                    if h["mmfleet-last"] == "1":
                        done.add(rid)
    finally:
        await consumer.stop()
    return out


def ask_kafka(fleet, topic: str, records: list[tuple[str | None, bytes, dict]], want: set[str]) -> dict:
    """Produce (request_id, value, headers) records with a plain aiokafka producer; collect replies."""
    async def go():
        await _topic(fleet["bootstrap"], topic)
        await _produce(fleet["bootstrap"], [(rid.encode() if rid else None, value,
                                             [(k, v.encode()) for k, v in headers.items()])
                                            for rid, value, headers in records])
        return await _replies(fleet["bootstrap"], topic, want)

    return asyncio.run(go())


def std(headers_extra: dict | None = None, topic: str = "") -> dict:
    return {"reply_to": topic, "authorization": f"Bearer {KEY}", **(headers_extra or {})}


def comparable(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k not in ("id", "created")}


# ------------------------------------------------------------------------- tests
def test_kafka_answer_equals_http_answer(fleet):
    topic = "mm.replies.equal"
    cases = {"k-text": body("Tell me about the sea."),
             "k-image": body(image_content(png_data_url(noise_image(5))))}
    got = ask_kafka(fleet, topic, [(rid, json.dumps(b).encode(), std(topic=topic)) for rid, b in cases.items()],
                    set(cases))
    for rid, b in cases.items():
        status, text, _ = http(fleet["base"], b)
        assert status == 200
        [(headers, reply)] = got[rid]
        assert headers == {"request_id": rid, "mmfleet-kind": "completion", "mmfleet-status": "200",
                           "mmfleet-seq": "0", "mmfleet-last": "1"}
        assert comparable(reply) == comparable(json.loads(text))
        assert reply["choices"][0]["message"]["content"]


def test_streamed_kafka_replies_arrive_in_order_and_end_with_a_terminal_one(fleet):
    topic = "mm.replies.stream"
    b = body(image_content(png_data_url(noise_image(6))), stream=True, stream_options={"include_usage": True})
    got = ask_kafka(fleet, topic, [("k-stream", json.dumps(b).encode(), std(topic=topic))], {"k-stream"})["k-stream"]
    assert [h["mmfleet-seq"] for h, _ in got] == [str(i) for i in range(len(got))]
    assert [h["mmfleet-last"] for h, _ in got] == ["0"] * (len(got) - 1) + ["1"]
    assert all(h["mmfleet-kind"] == "chunk" and r["object"] == "chat.completion.chunk" for h, r in got)
    text = "".join(r["choices"][0]["delta"].get("content") or "" for _, r in got if r["choices"])
    whole = json.loads(http(fleet["base"], {**b, "stream": False, "stream_options": None})[1])
    assert text == whole["choices"][0]["message"]["content"]
    assert got[-1][1]["usage"] == whole["usage"]
    assert got[-2][1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_bad_requests_each_get_an_error_reply(fleet):
    topic = "mm.replies.bad"
    bad_image = body(image_content("data:image/png;base64," + base64.b64encode(b"not a png").decode()))
    ok = json.dumps(body("hi")).encode()
    records = [("b-json", b"{not json", std(topic=topic)),
               ("b-image", json.dumps(bad_image).encode(), std(topic=topic)),
               ("b-nokey", ok, {"reply_to": topic}),
               ("b-wrongkey", ok, {"reply_to": topic, "authorization": "Bearer sk-wrong"}),
               ("b-noreply", ok, {"authorization": f"Bearer {KEY}"})]
    got = ask_kafka(fleet, topic, records, {"b-json", "b-image"})
    errors = asyncio.run(_replies(fleet["bootstrap"], "mm.replies.errors", {"b-nokey", "b-wrongkey", "b-noreply"}))
    # a record without a valid key is answered on the errors topic only, never on its reply_to
    assert not {"b-nokey", "b-wrongkey"} & set(got)
    expected = {"b-json": (got, 400, None), "b-image": (got, 400, None), "b-nokey": (errors, 401, "missing_api_key"),
                "b-wrongkey": (errors, 401, "invalid_api_key"), "b-noreply": (errors, 400, "missing_reply_to")}
    for rid, (where, status, code) in expected.items():
        [(headers, reply)] = where[rid]
        assert (headers["mmfleet-kind"], headers["mmfleet-status"], headers["mmfleet-last"]) == \
            ("error", str(status), "1")
        assert reply["error"]["message"]
        if code:
            assert reply["error"]["code"] == code
        SEEN_TEXT.append(json.dumps(reply))
    assert got["b-json"][0][1]["error"]["message"].startswith("invalid request body")
    assert "messages[0].content[0]" in got["b-image"][0][1]["error"]["message"]
    # the same texts as HTTP gives for the same bodies
    assert json.loads(http(fleet["base"], b"{not json")[1]) == got["b-json"][0][1]
    assert json.loads(http(fleet["base"], ok, key=None)[1]) == errors["b-nokey"][0][1]


async def _end_offsets(bootstrap: str, topic: str) -> dict:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    try:
        await consumer.topics()  # the cluster's metadata, so that the topic's partitions are known
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        return {tp.partition: off for tp, off in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


async def _topics(bootstrap: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return await admin.list_topics()
    finally:
        await admin.close()


def test_replies_go_only_to_existing_reply_topics_never_to_the_fleets_own(fleet):
    ok = json.dumps(body("hi")).encode()
    before = asyncio.run(_end_offsets(fleet["bootstrap"], "mm.decode"))
    records = [("t-stage", ok, std(topic="mm.decode")), ("t-requests", ok, std(topic="mm.requests")),
               ("t-new", ok, std(topic="mm.replies.never-created")), ("t-odd", ok, std(topic="elsewhere"))]
    asyncio.run(_produce(fleet["bootstrap"], [(rid.encode(), v, [(k, x.encode()) for k, x in h.items()])
                                              for rid, v, h in records]))
    errors = asyncio.run(_replies(fleet["bootstrap"], "mm.replies.errors", {r[0] for r in records}))
    for rid, *_ in records:
        [(headers, reply)] = errors[rid]
        assert (headers["mmfleet-status"], reply["error"]["code"], reply["error"]["param"]) == \
            ("400", "invalid_reply_to", "reply_to")
    assert asyncio.run(_end_offsets(fleet["bootstrap"], "mm.decode")) == before  # nothing written there
    topics = asyncio.run(_topics(fleet["bootstrap"]))
    assert "mm.replies.never-created" not in topics and "elsewhere" not in topics  # no topic created


def test_ids_are_bounded_claimed_only_after_authentication_and_scoped_per_key(fleet):
    topic = "mm.replies.ids"
    ok = json.dumps(body("Say something.")).encode()
    wrong = {"reply_to": topic, "authorization": "Bearer sk-wrong"}
    # an unauthenticated record first: it must not take the id away from its owner
    asyncio.run(_produce(fleet["bootstrap"], [(b"i-shared", ok, [(k, v.encode()) for k, v in wrong.items()])]))
    asyncio.run(_replies(fleet["bootstrap"], "mm.replies.errors", {"i-shared"}))
    other = {"reply_to": topic, "authorization": f"Bearer {OTHER_KEY}"}
    long_id = "i-" + "x" * 300
    got = ask_kafka(fleet, topic, [("i-shared", ok, std(topic=topic)), ("i-shared", ok, other),
                                   (long_id, ok, std(topic=topic))], {"i-shared", ""})
    for _ in range(120):  # the second key's answer to the same id may come after the first's
        if len(got["i-shared"]) >= 2:
            break
        time.sleep(1)
        got = asyncio.run(_replies(fleet["bootstrap"], topic, {"i-shared", ""}))
    replies = [reply for _headers, reply in got["i-shared"]]
    assert len(replies) == 2 and all(r["object"] == "chat.completion" for r in replies)  # one per key
    [(headers, reply)] = got[""]  # the long id is neither echoed nor claimed
    assert (headers["mmfleet-status"], reply["error"]["code"]) == ("400", "invalid_request_id")


def test_a_duplicate_request_id_is_answered_once(fleet):
    topic = "mm.replies.dup"
    value = json.dumps(body("Say something.")).encode()

    async def go():
        await _topic(fleet["bootstrap"], topic)
        headers = [(k, v.encode()) for k, v in std(topic=topic).items()]
        metas = await _produce(fleet["bootstrap"], [(b"d-1", value, headers)] * 3)
        first = await _replies(fleet["bootstrap"], topic, {"d-1"})
        # once the ingress has committed past every copy, all of them were handled
        probe = AIOKafkaConsumer(bootstrap_servers=fleet["bootstrap"], group_id="mmfleet.ingress",
                                 enable_auto_commit=False)
        await probe.start()
        try:
            from aiokafka import TopicPartition

            tp = TopicPartition("mm.requests", metas[-1].partition)
            for _ in range(600):
                if (await probe.committed(tp) or 0) > metas[-1].offset:
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("the ingress never committed the duplicates")
        finally:
            await probe.stop()
        return first, await _replies(fleet["bootstrap"], topic, {"d-1"})

    first, after = asyncio.run(go())
    assert len(first["d-1"]) == 1 and len(after["d-1"]) == 1


def test_http_keys_401_without_or_with_a_wrong_key_and_429_over_the_rate(fleet):
    b = body("hello")
    assert http(fleet["base"], b, key=None)[0] == 401
    status, text, _ = http(fleet["base"], b, key="sk-not-a-key")
    assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"
    assert http(fleet["base"], b)[0] == 200
    # the limit counts per clock minute: three requests straddling a minute's end would be
    # counted in two windows (a CI run saw a third 200), so start them well inside one
    left_s = 60 - time.time() % 60
    if left_s < 10:
        time.sleep(left_s + 0.2)
    statuses = [http(fleet["base"], b, key=LIMITED_KEY) for _ in range(3)]
    assert [s for s, _, _ in statuses[:2]] == [200, 200]
    status, text, headers = statuses[2]
    assert status == 429 and json.loads(text)["error"]["code"] == "rate_limit_exceeded"
    assert int(headers["Retry-After"]) >= 1


def test_submit_runs_200_mixed_requests_and_resumes(fleet, tmp_path):
    lines = []
    for i in range(200):
        if i % 10 == 9:
            b = body(image_content("data:image/png;base64,AAAA"))  # a bad image: an error reply
        elif i % 4 == 0:
            b = body(image_content(png_data_url(noise_image(100 + i % 3, size=(48, 40)))))
        elif i % 4 == 1:
            b = body(f"Request number {i}", stream=True)
        else:
            b = body(f"Request number {i}")
        lines.append(json.dumps({"custom_id": f"s-{i}", "url": "/v1/chat/completions", "body": b}))
    lines.append(json.dumps({"custom_id": "s-text", "url": "/v1/completions",
                             "body": {"model": "mmfleet-demo", "prompt": "Once", "max_tokens": 4,
                                      "temperature": 0}}))
    src, out, key_file = tmp_path / "batch.jsonl", tmp_path / "replies.jsonl", tmp_path / "key"
    src.write_text("\n".join(lines) + "\n")
    key_file.write_text(KEY)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(procs.REPO), "KAFKA_BOOTSTRAP": fleet["bootstrap"],
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "services.cli", "submit", str(src), str(out), "--api-key-file", str(key_file)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=procs.REPO)
    SEEN_TEXT.extend([run.stdout, run.stderr])
    assert run.returncode == 0, run.stderr[-2000:]
    replies = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in replies}
    assert len(replies) == 201 and set(by_id) == {f"s-{i}" for i in range(200)} | {"s-text"}
    for i in range(200):
        r = by_id[f"s-{i}"]
        if i % 10 == 9:
            assert r["response"]["status_code"] == 400 and r["error"]["message"]
        elif i % 4 == 1:
            assert isinstance(r["response"]["body"], list) and r["response"]["body"][-1]["choices"][0]["finish_reason"]
        else:
            assert r["response"]["status_code"] == 200 and r["response"]["body"]["choices"][0]["message"]["content"]
    assert by_id["s-text"]["response"]["body"]["object"] == "text_completion"
    assert "wrote 201 replies" in run.stdout
    # resumed: nothing left to send, nothing written twice
    again = subprocess.run(cmd + ["--no-progress"], env=env, capture_output=True, text=True, timeout=300,
                           cwd=procs.REPO)
    SEEN_TEXT.extend([again.stdout, again.stderr])
    assert again.returncode == 0 and "sent 0, skipped 201" in again.stdout
    assert len(out.read_text().splitlines()) == 201


def test_with_the_share_setting_two_keys_hit_one_cache_entry(fleet):
    import redis

    r = redis.Redis.from_url(fleet["env"]["REDIS_URL"], password=REDIS_PASSWORD)
    encoded = RedisKeys("ing").encoder_items()
    b = body(image_content(png_data_url(noise_image(9191))))
    before = int(r.get(encoded) or 0)
    (s1, a1, _), (s2, a2, _) = http(fleet["base"], b, KEY), http(fleet["base"], b, OTHER_KEY)
    assert (s1, s2) == (200, 200) and int(r.get(encoded) or 0) - before == 1  # the second key hit the first's
    assert json.loads(a1)["choices"][0]["message"] == json.loads(a2)["choices"][0]["message"]
    r.close()


def test_no_secret_in_logs_cli_output_or_error_bodies(fleet, fleet_logs):
    """Runs last: every log file of this fleet (--log-dir), every CLI output and error body seen."""
    settings_out = subprocess.run([sys.executable, "-m", "services.cli", "settings"], capture_output=True,
                                  text=True, cwd=procs.REPO,
                                  env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(procs.REPO), **fleet["env"]})
    assert settings_out.returncode == 0
    texts = {"mmfleet settings": settings_out.stdout + settings_out.stderr}
    texts.update({f"seen[{i}]": t for i, t in enumerate(SEEN_TEXT)})
    logs = sorted(p for p in fleet_logs.rglob("*") if p.is_file())
    assert any(p.name == "gateway.log" for p in logs) and any("log" in p.name for p in logs)
    texts.update({str(p): p.read_text(errors="replace") for p in logs})
    assert len(SEEN_TEXT) >= 5  # the tests above did produce error bodies and CLI output
    pages = asyncio.run(_metrics_pages(fleet))
    assert len(pages) >= 2  # the gateway and the (epd) worker
    texts.update(pages)
    for name, text in texts.items():
        for secret in SECRETS:
            assert secret not in text, f"a secret appears in {name}"


async def _metrics_pages(fleet) -> dict[str, str]:
    """``/metrics`` of every process of the fleet (found through the liveness records)."""
    settings = settings_mod.from_env(fleet["env"])
    redis = make_redis(settings)
    try:
        keys = RedisKeys(settings.redis_prefix)
        urls = [g.url + "/metrics" for g in await live_gateways(redis, keys)]
        urls += [f"http://127.0.0.1:{w.metrics_port}/metrics" for w in await live_workers(redis, keys)]
    finally:
        await redis.aclose()
    pages = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as resp:
            pages[url] = resp.read().decode()
    return pages
