"""The harness's Redis command census (loadtest/rediscount.py): the server's own counters read
before and after a window, per finished request, and the report's table."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from loadtest import rediscount
from tests import procs


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own: the session's is shared with fleets whose commands
    (a stopping fleet's last polls) would land in the window."""
    with procs.redis_server(tmp_path) as url:
        yield url


async def test_a_window_counts_the_commands_run_in_it_scripts_included(own_redis):
    redis_url = own_redis
    r = aioredis.from_url(redis_url)
    try:
        script = r.register_script("redis.call('set', KEYS[1], ARGV[1]); return redis.call('get', KEYS[1])")
        await script(keys=["census:warm"], args=["0"])  # loaded: the window's calls are EVALSHA
        async with rediscount.Census(redis_url) as census:
            for i in range(4):  # 2 requests' worth: 2 script calls and 2 plain GETs each
                await script(keys=[f"census:{i}"], args=[str(i)])
                await r.get(f"census:{i}")
            await census.read_after()
    finally:
        await r.aclose()
    calls = census.per_request(2)
    assert calls == {"get": 4.0, "evalsha": 2.0, "set": 2.0}  # 4 GETs: 2 inside the scripts, 2 plain
    assert next(iter(calls)) == "get"  # largest first; the census's own commands left out


async def test_no_redis_no_figure():
    for url in (None, "redis://127.0.0.1:1/0"):  # none, or nobody there: left out, no failure
        async with rediscount.Census(url) as census:
            await census.read_after()
        assert census.per_request(3) == {}
    assert rediscount.per_request(None, {"get": 3}, 1) == {}
    assert rediscount.per_request({"get": 1}, {"get": 3}, 0) == {}


def test_the_table_lists_each_runs_commands_per_request():
    runs = [{"target": "fleet:e-p-d", "label": "c=1", "redis_commands": {"evalsha": 14.5, "xread": 12.0, "get": 1.0}},
            {"target": "fleet:e-p-d", "label": "c=8", "redis_commands": {"evalsha": 9.5, "publish": 5.0}},
            {"target": "inproc", "label": "c=1", "redis_commands": {}}]
    md = "\n".join(rediscount.commands_md(runs))
    assert "## Redis commands per request" in md
    assert "| command | `fleet:e-p-d` c=1 | `fleet:e-p-d` c=8 |" in md  # a target without counts has no column
    assert "| evalsha | 14.5 | 9.5 |" in md and "| publish | 0.0 | 5.0 |" in md
    assert "| **all** | 27.5 | 14.5 |" in md
    assert rediscount.commands_md(runs[2:]) == []
