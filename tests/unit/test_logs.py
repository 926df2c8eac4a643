"""The one log formatter: JSON lines carry the request id and stage bound in context."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from shared import logs


@pytest.fixture
def capture():
    """A logger writing through ``logs.make_handler`` into a buffer; returns (logger, read())."""
    handlers = []

    def make(fmt: str):
        buf = io.StringIO()
        handler = logs.make_handler(fmt, buf)
        logger = logging.getLogger(f"test.logs.{fmt}")
        logger.handlers[:] = [handler]
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        handlers.append((logger, handler))
        return logger, buf

    yield make
    for logger, handler in handlers:
        logger.removeHandler(handler)


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_line_has_every_field_and_the_request_id(capture):
    log, buf = capture("json")
    logs.set_process("decode-host-1-abc")
    with logs.bind(request_id="chatcmpl-42", stage="decode"):
        log.info("handled %s in %d ms", "it", 5)
    log.warning("outside any request")
    inside, outside = lines(buf)
    assert inside["msg"] == "handled it in 5 ms"
    assert inside["request_id"] == "chatcmpl-42" and inside["stage"] == "decode"
    assert inside["level"] == "INFO" and inside["logger"] == "test.logs.json"
    assert inside["process"] == "decode-host-1-abc" and isinstance(inside["pid"], int)
    assert inside["ts"].endswith("Z") and "T" in inside["ts"]
    assert "request_id" not in outside and "stage" not in outside and outside["level"] == "WARNING"


def test_exceptions_are_one_json_line(capture):
    log, buf = capture("json")
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        log.exception("failed")
    (rec,) = lines(buf)  # a multi-line traceback stays inside one JSON line
    assert rec["msg"] == "failed" and "RuntimeError: boom" in rec["exc"]


def test_concurrent_tasks_keep_their_own_request_id(capture):
    log, buf = capture("json")

    async def one(rid: str) -> None:
        with logs.bind(request_id=rid):
            for i in range(3):
                await asyncio.sleep(0)
                log.info("%s step %d", rid, i)

    async def main():
        await asyncio.gather(*(one(f"r{i}") for i in range(4)))

    asyncio.run(main())
    recs = lines(buf)
    assert len(recs) == 12
    assert all(r["msg"].startswith(r["request_id"] + " ") for r in recs)


def test_text_format_shows_stage_and_request_id(capture):
    log, buf = capture("text")
    with logs.bind(request_id="cmpl-7", stage="encode"):
        log.info("hello")
    assert "[encode cmpl-7] hello" in buf.getvalue()


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="log_format"):
        logs.make_handler("xml")


def test_debug_keeps_the_kafka_and_redis_clients_at_info():
    from shared.settings import Settings

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {n: logging.getLogger(n).level for n in ("aiokafka", "kafka", "redis")}
    try:
        logs.setup(Settings(log_level="DEBUG"), process="test")
        assert logging.getLogger("services.runner").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("aiokafka.consumer.fetcher").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("redis.asyncio.connection").isEnabledFor(logging.DEBUG)
        logs.setup(Settings(log_level="WARNING"), process="test")
        assert not logging.getLogger("aiokafka").isEnabledFor(logging.INFO)  # never below the chosen level
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, was in levels.items():
            logging.getLogger(name).setLevel(was)
