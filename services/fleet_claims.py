"""What one ``mmfleet up`` owns, claimed before it starts or bumps anything: its broker and its
gateway port on this host (an exclusive ``flock`` each, held by the supervisor alone; the kernel
drops it when that process ends, however it ends), and its namespace in Redis (``keys.fleet()``,
a ``FleetInfo`` with a TTL the supervisor refreshes). A broker's consumer groups and topics, and
a prefix's liveness records and broker tokens, are one fleet's: a second fleet that would share
one refuses to start, naming what is taken and how to choose another (:class:`Taken`).
Design: docs/guide/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import redis.asyncio as aioredis

from shared import protocol
from shared.keys import RedisKeys
from shared.process import hostaddr
from shared.settings import Settings, redact_url
from shared.transport.redis_conn import make_redis

log = logging.getLogger("mmfleet.up")

LOCK_DIR = Path(tempfile.gettempdir()) / "mmfleet-locks"  # one per host: every user's fleets meet here
CLAIM_TTL_MS = 15_000  # a supervisor gone without releasing its Redis claim blocks a new one this long at most
CLAIM_REFRESH_S = 3.0

# set ours unless another fleet holds it (a claim that lapsed while Redis was paused or flushed comes back)
_REFRESH = """local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_TAKE_OVER = """if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1"""


class Taken(Exception):
    """Another fleet owns something this one needs; the message says what and how to choose another."""


def _first_address(bootstrap: str) -> tuple[str, int]:
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port or 9092)


def _resolved(host: str) -> str:
    """One spelling per address, so ``localhost`` and ``127.0.0.1`` take the same lock."""
    try:
        return socket.gethostbyname(host)  # IPv4, as the broker's clients connect first
    except OSError:  # an IPv6 literal, a name that does not resolve: as written
        return host


def free_port_near(port: int) -> int:
    """A port above ``port`` that nothing listens on now (for the refusal's example)."""
    for candidate in range(port + 1, port + 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return candidate
    return port + 1000


def _alive_here(info: protocol.FleetInfo) -> bool:
    if info.host != socket.gethostname():
        return True  # another host's: only its TTL tells
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True


def _who(info: protocol.FleetInfo | None) -> str:
    if info is None:
        return "another `mmfleet up`"
    return f"another `mmfleet up` (pid {info.pid} on {info.host}, gateway {info.gateway_url})"


class FleetClaims:
    """Take with :meth:`take_host` (first thing), then :meth:`take_redis` once Redis answers and
    before any broker token is bumped; :meth:`hold` refreshes the Redis claim until cancelled;
    :meth:`release` (idempotent) gives everything back."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.info = protocol.FleetInfo(
            fleet_id=uuid.uuid4().hex, pid=os.getpid(), host=socket.gethostname(),
            gateway_url=hostaddr.http_url(settings.gateway_host, settings.gateway_port),
            kafka_bootstrap=settings.kafka_bootstrap, redis_prefix=settings.redis_prefix,
            started_unix_ms=int(time.time() * 1000))
        self._value = msgspec.json.encode(self.info)
        self._key = RedisKeys(settings.redis_prefix).fleet()
        self._locks: list[tuple[Path, int]] = []  # (lock file, its descriptor) held
        self._redis: aioredis.Redis | None = None

    # ------------------------------------------------------------------ this host
    def take_host(self) -> None:
        s = self.settings
        khost, kport = _first_address(s.kafka_bootstrap)
        taken, holder = self._lock(f"broker-{_resolved(khost)}-{kport}")
        if taken:
            raise Taken(
                f"{_who(holder)} runs on the broker at {khost}:{kport}; one broker serves one fleet (its topics "
                f"and consumer groups are the fleet's). For a second fleet on this host give it a broker of its "
                f"own, e.g. --kafka-bootstrap 127.0.0.1:{free_port_near(kport)} "
                f"--port {free_port_near(s.gateway_port)} with MMFLEET_REDIS_PREFIX=<name> (or --redis-url)")
        taken, holder = self._lock(f"gateway-port-{s.gateway_port}")
        if taken or not _bindable(s.gateway_host, s.gateway_port):
            self.release_host()  # all or nothing
            by = _who(holder) if taken else "another process"
            raise Taken(f"the gateway port {s.gateway_port} on {s.gateway_host} is taken by {by}: choose another "
                        f"with --port PORT (MMFLEET_GATEWAY_PORT), e.g. --port {free_port_near(s.gateway_port)}")

    def _lock(self, name: str) -> tuple[bool, protocol.FleetInfo | None]:
        """(held by another, who: None when unreadable); not held by another: held by us now."""
        if not LOCK_DIR.exists():
            with contextlib.suppress(FileExistsError):
                LOCK_DIR.mkdir()
                os.chmod(LOCK_DIR, 0o1777)  # sticky and shared, as /tmp: one lock per port whoever runs
        path = LOCK_DIR / f"{name}.lock"
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except PermissionError:  # another user's lock file: reading it is enough to lock it
                fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raw = os.pread(fd, 4096, 0)
                os.close(fd)
                try:
                    return True, msgspec.json.decode(raw, type=protocol.FleetInfo)
                except msgspec.DecodeError:
                    return True, None
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder removed that file as we locked it: lock the one there now
        with contextlib.suppress(OSError):  # who holds it, for the next one's refusal
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._value, 0)
        self._locks.append((path, fd))
        return False, None

    # ------------------------------------------------------------------ Redis
    async def take_redis(self) -> None:
        self._redis = redis = make_redis(self.settings)
        if await redis.set(self._key, self._value, nx=True, px=CLAIM_TTL_MS):
            return
        raw = await redis.get(self._key)
        holder = None
        with contextlib.suppress(msgspec.DecodeError, TypeError):
            holder = msgspec.json.decode(raw, type=protocol.FleetInfo)
        if holder is not None and not _alive_here(holder):  # its supervisor died without releasing it
            if await redis.eval(_TAKE_OVER, 1, self._key, raw, self._value, CLAIM_TTL_MS):
                log.warning("took over the Redis prefix %r of a fleet whose supervisor (pid %d) is gone",
                            self.settings.redis_prefix, holder.pid)
                return
        self._redis = None
        await redis.aclose()
        raise Taken(f"the Redis prefix {self.settings.redis_prefix!r} at {redact_url(self.settings.redis_url)} "
                    f"is the namespace of {_who(holder)}, whose liveness records and broker tokens live there: "
                    f"give this fleet its own with MMFLEET_REDIS_PREFIX=<name> (or another Redis with --redis-url)")

    async def hold(self) -> None:
        """Refresh the Redis claim until cancelled; Redis away or another fleet's claim is logged."""
        while True:
            await asyncio.sleep(CLAIM_REFRESH_S)
            try:
                if not await self._redis.eval(_REFRESH, 1, self._key, self._value, CLAIM_TTL_MS):
                    log.error("another fleet claimed the Redis prefix %r while this one ran",
                              self.settings.redis_prefix)
            except (aioredis.RedisError, OSError) as exc:
                log.warning("could not refresh the fleet's Redis claim: %r", exc)

    async def release(self) -> None:
        redis, self._redis = self._redis, None
        if redis is not None:
            with contextlib.suppress(aioredis.RedisError, OSError):
                await redis.eval(_RELEASE, 1, self._key, self._value)
            await redis.aclose()
        self.release_host()

    def release_host(self) -> None:
        for path, fd in self._locks:
            with contextlib.suppress(OSError):  # removed while held: a taker that opened it sees so
                path.unlink()
            os.close(fd)
        self._locks.clear()


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
