"""``mmfleet submit``: run a JSONL file of requests through the Kafka ingress, replies to JSONL.

Input, one per line in the OpenAI Batch API shape: ``{"custom_id", "url", "body"}`` (``url``
optional, ``/v1/completions`` for text completions); ``custom_id`` is the request_id, unique.
Output, one line per answer: ``{"custom_id", "response": {"status_code", "body"}, "error"}``
(streamed: ``body`` is the chunks in order; an error sets ``error`` to the OpenAI error object).
Resumable: ids already in the output are not sent again, and the reply topic is read from its
start, so a reply that arrived before an interruption is still found. At most
``max_outstanding`` requests are unanswered at once. Design: docs/guide/kafka-ingress.md.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from shared.keys import TOPIC_REQUESTS
from shared.settings import Settings
from shared.transport.bus import ensure_topics, kafka_client_kwargs


@dataclass
class SubmitResult:
    sent: int = 0
    skipped: int = 0  # already in the output file
    written: int = 0
    errors: int = 0  # replies that are error bodies
    seen: dict[str, list] = field(default_factory=dict, repr=False)


def default_reply_topic(input_path: Path) -> str:
    """A stable reply topic per input file, so a resumed run reads the replies of the first."""
    return "mm.replies." + (re.sub(r"[^A-Za-z0-9._-]", "_", input_path.stem)[:180] or "submit")


def read_requests(path: Path) -> list[tuple[str, str, bytes]]:
    """(request_id, endpoint, body JSON) per line; raises ``ValueError`` naming the line."""
    out, ids = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rid, body = str(obj["custom_id"]), obj["body"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a {{custom_id, body}} JSON object ({type(exc).__name__})") from None
        if rid in ids:
            raise ValueError(f"{path}:{n}: custom_id {rid!r} appears twice")
        ids.add(rid)
        endpoint = "completions" if obj.get("url", "").rstrip("/").endswith("/completions") and \
            "chat" not in obj.get("url", "") else "chat.completions"
        out.append((rid, endpoint, json.dumps(body).encode()))
    return out


def answered_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    done = set()
    for line in path.read_text().splitlines():
        try:
            done.add(json.loads(line)["custom_id"])
        except (ValueError, KeyError):
            continue  # a line cut short by an interruption: that request is asked again
    return done


def _header(record, name: str) -> str:
    for key, value in record.headers or ():
        if key == name:
            return value.decode()
    return ""


async def submit(settings: Settings, input_path: Path, output_path: Path, *, reply_topic: str | None = None,
                 api_key: str | None = None, max_outstanding: int = 1000, progress: bool = True,
                 idle_timeout_s: float = 600.0) -> SubmitResult:
    """Send every request of ``input_path`` not yet in ``output_path`` and append their replies.

    Returns when every sent request is answered; raises ``TimeoutError`` when no reply
    arrives for ``idle_timeout_s`` while some are outstanding (what was written stays)."""
    from tqdm import tqdm

    requests = read_requests(input_path)
    done = answered_ids(output_path)
    todo = [r for r in requests if r[0] not in done]
    result = SubmitResult(skipped=len(requests) - len(todo))
    topic = reply_topic or default_reply_topic(input_path)
    await ensure_topics(settings, (topic,))
    wanted = {rid for rid, _, _ in todo}
    slots = asyncio.Semaphore(max_outstanding)
    if not todo:
        return result
    consumer = AIOKafkaConsumer(topic, **kafka_client_kwargs(settings), group_id=None,
                                auto_offset_reset="earliest", fetch_max_wait_ms=settings.fetch_max_wait_ms)
    producer = AIOKafkaProducer(**kafka_client_kwargs(settings), acks="all", linger_ms=5)
    await consumer.start()
    await producer.start()
    bar = tqdm(total=len(todo), unit="req", desc="mmfleet submit", disable=not progress)
    try:
        with output_path.open("a") as out:
            async def collect() -> None:
                while wanted:
                    batches = await consumer.getmany(timeout_ms=1000)
                    for records in batches.values():
                        for record in records:
                            if _take(record, wanted, result, out):
                                slots.release()
                                bar.update(1)
                    if not batches:
                        idle = asyncio.get_running_loop().time() - last_reply[0]
                        if idle > idle_timeout_s:
                            raise TimeoutError(f"no reply for {idle_timeout_s:.0f} s; {len(wanted)} outstanding")
                    else:
                        last_reply[0] = asyncio.get_running_loop().time()

            last_reply = [asyncio.get_running_loop().time()]
            collector = asyncio.create_task(collect())
            headers = [("reply_to", topic.encode())]
            if api_key:
                headers.append(("authorization", f"Bearer {api_key}".encode()))
            for rid, endpoint, body in todo:
                slot = asyncio.ensure_future(slots.acquire())
                await asyncio.wait({slot, collector}, return_when=asyncio.FIRST_COMPLETED)
                if collector.done():  # it failed (or nothing is left to wait for): stop sending
                    slot.cancel()
                    break
                await producer.send_and_wait(TOPIC_REQUESTS, body, key=rid.encode(),
                                             headers=headers + [("endpoint", endpoint.encode())])
                result.sent += 1
            await collector
    finally:
        bar.close()
        await producer.stop()
        await consumer.stop()
    return result


def _take(record, wanted: set[str], result: SubmitResult, out) -> bool:
    """Fold one reply record in; True when it completed a wanted request (written to ``out``)."""
    rid = (record.key or b"").decode()
    if rid not in wanted:
        return False
    kind, seq = _header(record, "mmfleet-kind"), int(_header(record, "mmfleet-seq") or 0)
    status = int(_header(record, "mmfleet-status") or 200)
    body = json.loads(record.value)
    parts = result.seen.setdefault(rid, [])
    if seq == 0:
        parts.clear()  # a reply sequence that starts again replaces the one before
    parts.append(body)
    if _header(record, "mmfleet-last") != "1":
        return False
    wanted.discard(rid)
    chunks = result.seen.pop(rid)
    is_error = kind == "error"
    line = {"custom_id": rid,
            "response": {"status_code": status, "body": chunks[0] if kind != "chunk" else chunks},
            "error": body.get("error") if is_error else None}
    if is_error and len(chunks) > 1:  # a stream that failed after some chunks: keep them
        line["response"]["body"] = chunks
    out.write(json.dumps(line) + "\n")
    out.flush()
    result.written += 1
    result.errors += is_error
    return True
