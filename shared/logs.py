"""One log setup for every process: text for people, JSON lines for machines.

``setup(settings, process=...)`` is called once in ``main``. Records carry the process's identity
(``process``: "gateway" or the worker id, :func:`set_process`) and, from context variables that
follow asyncio tasks, the ``stage`` and ``request_id`` being worked on (:func:`bind`), so one
request id can be grepped through every stage's log. JSON fields: ts (RFC 3339 UTC, ms), level,
logger, pid, process, stage, request_id, msg, and exc (the traceback); unset fields are left out.

Design: docs/guide/observability.md.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import orjson

request_id_var: ContextVar[str | None] = ContextVar("mmfleet_request_id", default=None)
stage_var: ContextVar[str | None] = ContextVar("mmfleet_stage", default=None)
_process_name = ""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]%(ctx)s %(message)s"


def set_process(name: str) -> None:
    """Name this process in every later record (a worker, once it knows its id)."""
    global _process_name
    _process_name = name


@contextmanager
def bind(*, request_id: str | None = None, stage: str | None = None) -> Iterator[None]:
    """Within this block (and tasks it starts), records carry ``request_id`` / ``stage``."""
    tokens = []
    if request_id is not None:
        tokens.append((request_id_var, request_id_var.set(request_id)))
    if stage is not None:
        tokens.append((stage_var, stage_var.set(stage)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class ContextFilter(logging.Filter):
    """Puts process / stage / request id on each record (a handler filter: it sees every record,
    including those of libraries that propagate to the root)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.stage = stage_var.get()
        record.proc_name = _process_name
        parts = [p for p in (record.stage, record.request_id) if p]
        record.ctx = f" [{' '.join(parts)}]" if parts else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring for the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "process": getattr(record, "proc_name", "") or None,
            "stage": getattr(record, "stage", None),
            "request_id": getattr(record, "request_id", None),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps({k: v for k, v in out.items() if v is not None}, default=str).decode()


def make_handler(log_format: str, stream=None) -> logging.Handler:
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(ContextFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif log_format == "text":
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    else:
        raise ValueError(f"log_format must be text or json, not {log_format!r}")
    return handler


_CHATTY_LIBRARIES = ("aiokafka", "kafka", "redis")


def setup(settings, *, process: str = "") -> None:
    """Replace the root logger's handlers with one in ``settings.log_format`` at
    ``settings.log_level``. Idempotent. At DEBUG the Kafka and Redis clients stay at INFO: theirs
    is a line per fetch and connection, which would bury the fleet's own."""
    set_process(process or f"pid-{os.getpid()}")
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(make_handler(settings.log_format))
    root.setLevel(settings.log_level.upper())
    for noisy in _CHATTY_LIBRARIES:
        logging.getLogger(noisy).setLevel(max(logging.INFO, root.level))
