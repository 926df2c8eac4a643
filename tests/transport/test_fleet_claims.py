"""A fleet's claims (``services.fleet_claims``) against a real redis-server: a second claim on
the same broker, gateway port or Redis prefix is refused naming what is taken and how to choose
another; released, each can be taken again; a prefix whose supervisor died on this host is
taken over; a port some other process listens on is refused too."""

from __future__ import annotations

import asyncio
import socket
import uuid

import msgspec
import pytest
import redis as redis_sync

from services.fleet_claims import FleetClaims, Taken
from shared import protocol
from shared import settings as settings_mod
from shared.keys import RedisKeys
from tests import procs


def _settings(redis_url: str, **kw) -> settings_mod.Settings:
    base = {"kafka_bootstrap": f"127.0.0.1:{procs.free_port()}", "gateway_port": procs.free_port(),
            "redis_url": redis_url, "redis_prefix": f"claims-{uuid.uuid4().hex[:8]}"}
    return settings_mod.from_env({}, **{**base, **kw})


def test_the_host_locks_refuse_a_second_fleet_until_the_first_lets_go(redis_url):
    s = _settings(redis_url)
    first, second = FleetClaims(s), FleetClaims(s)
    first.take_host()
    try:
        with pytest.raises(Taken, match=rf"runs on the broker at {s.kafka_bootstrap}.*--kafka-bootstrap 127\.0\.0\.1:"):
            second.take_host()
        # another broker, the same gateway port
        other = s.with_overrides(kafka_bootstrap=f"localhost:{procs.free_port()}")
        with pytest.raises(Taken, match=rf"the gateway port {s.gateway_port} on 127.0.0.1 is taken by another "
                                        rf"`mmfleet up` \(pid \d+"):
            FleetClaims(other).take_host()
        beside = FleetClaims(other.with_overrides(gateway_port=procs.free_port()))
        beside.take_host()  # all or nothing: the refused claim kept no lock on that broker
        beside.release_host()
        # the same broker under another name is the same broker
        with pytest.raises(Taken, match="runs on the broker"):
            FleetClaims(s.with_overrides(kafka_bootstrap=s.kafka_bootstrap.replace("127.0.0.1", "localhost"),
                                         gateway_port=procs.free_port())).take_host()
    finally:
        first.release_host()
    second.take_host()  # free again
    second.release_host()


def test_a_port_another_process_listens_on_is_refused(redis_url):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        s = _settings(redis_url, gateway_port=listener.getsockname()[1])
        claims = FleetClaims(s)
        try:
            with pytest.raises(Taken, match="is taken by another process: choose another with --port"):
                claims.take_host()
        finally:
            claims.release_host()


def test_the_redis_prefix_is_one_fleets(redis_url):
    s = _settings(redis_url)

    async def go():
        first, second = FleetClaims(s), FleetClaims(s)
        await first.take_redis()
        with pytest.raises(Taken, match=rf"the Redis prefix '{s.redis_prefix}' .* is the namespace of another "
                                        r"`mmfleet up` \(pid \d+ .*MMFLEET_REDIS_PREFIX=<name>"):
            await second.take_redis()
        await first.release()
        await second.take_redis()
        await second.release()

    asyncio.run(go())


def test_a_prefix_whose_supervisor_died_here_is_taken_over(redis_url):
    s = _settings(redis_url)
    dead = protocol.FleetInfo(fleet_id="gone", pid=2 ** 22 + 17, host=socket.gethostname(), gateway_url="u",
                              kafka_bootstrap="b", redis_prefix=s.redis_prefix, started_unix_ms=0)
    r = redis_sync.Redis.from_url(redis_url)
    r.set(RedisKeys(s.redis_prefix).fleet(), msgspec.json.encode(dead), px=60_000)

    async def go():
        claims = FleetClaims(s)
        await claims.take_redis()
        await claims.release()

    try:
        asyncio.run(go())
        assert r.get(RedisKeys(s.redis_prefix).fleet()) is None  # released as its own
    finally:
        r.close()
