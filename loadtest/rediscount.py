"""The Redis commands a target runs per finished request, counted by the server itself.

Read from ``INFO commandstats`` before and after each load window: a count, so, unlike the
timings, it does not move with what else the machine is doing, and a change that removes a
round trip shows at once. The counts are the server's: a command a script runs counts as well as
the ``EVALSHA`` that ran it, and everything the server did during the window counts, the
fleet's idle polling too (a few commands a second per consumer). Only for targets whose Redis
the harness can read (fleets, and ``url:`` targets given ``--redis-url``).
Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from loadtest.mdtable import runs_header

TOP = 14  # commands listed in the report; the rest are summed in "other"


class Census:
    """``async with Census(url) as census:`` … ``await census.read_after()``; then
    ``census.per_request(n)``. One connection for both readings, opened before the first, so
    its own handshake is not counted. Without a Redis (or one that cannot be read) the figures
    are left out, never the run."""

    def __init__(self, redis_url: str | None) -> None:
        self._url = redis_url
        self._redis: aioredis.Redis | None = None
        self._before: dict[str, int] | None = None
        self._after: dict[str, int] | None = None

    async def __aenter__(self) -> Census:
        if self._url:
            self._redis = aioredis.from_url(self._url)
            self._before = await self._read()
        return self

    async def __aexit__(self, *exc) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    async def read_after(self) -> None:
        self._after = await self._read()

    def per_request(self, requests: int) -> dict[str, float]:
        return per_request(self._before, self._after, requests)

    async def _read(self) -> dict[str, int] | None:
        """Calls so far per command (``set``, ``evalsha``, ...); None without a Redis to ask."""
        if self._redis is None:
            return None
        try:
            stats = await self._redis.info("commandstats")
        except Exception:  # noqa: BLE001 - a figure left out ("–"), never a failed run
            return None
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def per_request(before: dict[str, int] | None, after: dict[str, int] | None, requests: int) -> dict[str, float]:
    """Calls per finished request during the window, by command, largest first."""
    if before is None or after is None or requests <= 0:
        return {}
    calls = {cmd: n - before.get(cmd, 0) for cmd, n in after.items()}
    calls.pop("info", None)  # the census's own reading
    return {cmd: n / requests for cmd, n in sorted(calls.items(), key=lambda kv: -kv[1]) if n > 0}


def commands_md(runs: list[dict]) -> list[str]:
    """A table: Redis commands per finished request, by command, one column per run."""
    runs = [r for r in runs if r.get("redis_commands")]
    if not runs:
        return []
    total: dict[str, float] = {}
    for r in runs:
        for cmd, n in r["redis_commands"].items():
            total[cmd] = max(total.get(cmd, 0.0), n)
    shown = sorted(total, key=lambda cmd: -total[cmd])[:TOP]
    out = ["## Redis commands per request", "",
           "Calls per finished request over each load window, from the server's `INFO commandstats` "
           "(commands run inside scripts count too; so does idle polling during the window).", "",
           *runs_header(("command",), runs)]
    out += [f"| {cmd} | " + " | ".join(f"{r['redis_commands'].get(cmd, 0.0):.1f}" for r in runs) + " |"
            for cmd in shown]
    if len(total) > len(shown):
        out.append("| other | " + " | ".join(
            f"{sum(n for cmd, n in r['redis_commands'].items() if cmd not in shown):.1f}" for r in runs) + " |")
    out += ["| **all** | " + " | ".join(f"{sum(r['redis_commands'].values()):.1f}" for r in runs) + " |", ""]
    return out
