"""What ``GET /ready`` answers: can a request of each kind this gateway takes be answered now?

That needs Redis (token streams), a broker the producer knows, and a live worker for every
stage on the path of each request kind: a text-only request enters at prefill, one with media
at media-fetch (``shared.stage.entry_message``), and each runs down the stage order from there.
Live workers are read from their liveness records (``shared.transport.liveness``), whose stages
say what each serves in any mode. 200 with the workers per stage; 503 naming what is missing.
``/health`` stays the cheap liveness answer. Design: docs/guide/api.md.
"""

from __future__ import annotations

import asyncio
import os

from services.stages import SPECS
from shared.keys import TOPIC_MEDIA_FETCH, TOPIC_PREFILL, RedisKeys
from shared.transport.liveness import live_workers

CHECK_TIMEOUT_S = 2.0  # each dependency answers within this or counts as not there


def request_paths(modalities: frozenset[str]) -> dict[str, tuple[str, ...]]:
    """Request kind -> the stages it passes through, for the kinds a gateway serving
    ``modalities`` takes (no modalities: text only)."""
    paths = {"text-only requests": _path_from(TOPIC_PREFILL)}
    if modalities:
        paths["requests with media"] = _path_from(TOPIC_MEDIA_FETCH)
    return paths


def _path_from(topic: str) -> tuple[str, ...]:
    start = next(i for i, spec in enumerate(SPECS) if spec.topic == topic)
    return tuple(spec.name for spec in SPECS[start:])


async def readiness(redis, producer, keys: RedisKeys, paths: dict[str, tuple[str, ...]]) -> tuple[int, dict]:
    """(HTTP status, body) of ``/ready``. The body always carries ``pid``, so a supervisor can
    tell its own gateway's answer from another process's on the same port."""
    ping, brokers, workers = await asyncio.gather(_bounded(redis.ping()), _bounded(_brokers(producer)),
                                                  _bounded(live_workers(redis, keys)), return_exceptions=True)
    problems = []
    if isinstance(ping, BaseException):
        problems.append(f"redis: {type(ping).__name__}")
    if isinstance(brokers, BaseException):
        problems.append(f"kafka: {type(brokers).__name__}")
    elif not brokers:
        problems.append("kafka: no brokers")
    body: dict = {"pid": os.getpid()}
    if isinstance(workers, BaseException):
        problems.append(f"workers: unknown, the liveness records are not readable ({type(workers).__name__})")
    else:
        needed = [s for s in SPECS if any(s.name in path for path in paths.values())]
        counts = {s.name: sum(s.name in w.stages for w in workers) for s in needed}
        missing = [name for name, n in counts.items() if n == 0]
        body.update(workers=counts, missing_stages=missing)
        for name in missing:
            kinds = " and ".join(kind for kind, path in paths.items() if name in path)
            problems.append(f"no live worker serves stage {name} (needed by {kinds})")
    if problems:
        return 503, {"status": "unavailable", "problems": problems, **body}
    return 200, {"status": "ready", **body}


async def _bounded(aw):
    return await asyncio.wait_for(aw, CHECK_TIMEOUT_S)


async def _brokers(producer) -> int:
    await producer.client.force_metadata_update()
    return len(producer.client.cluster.brokers())
