"""Counting a redis-py client's round trips in transport tests: each lone command is recorded by
its name, each pipeline by its number of commands; so is each call of a ``LeanRedis`` opened on
that client (shared.transport.redis_lean)."""

from __future__ import annotations

from shared.transport.redis_lean import LeanRedis


def count_round_trips(monkeypatch, redis) -> list:
    """Patch ``redis`` (until the test ends) so that every round trip is appended to the list
    returned: a command's name, or a pipeline's command count."""
    sent: list = []
    pipeline, command = redis.pipeline, redis.execute_command

    async def counted_command(*a, **kw):
        sent.append(a[0])
        return await command(*a, **kw)

    def counted_pipeline(*a, **kw):
        pipe = pipeline(*a, **kw)
        execute = pipe.execute

        async def counted_execute(*ea, **ekw):
            sent.append(len(pipe.command_stack))
            return await execute(*ea, **ekw)

        pipe.execute = counted_execute
        return pipe

    monkeypatch.setattr(redis, "pipeline", counted_pipeline)
    monkeypatch.setattr(redis, "execute_command", counted_command)
    lean_call = LeanRedis.call

    async def counted_lean(self, *a, **kw):
        if self.client is redis:
            sent.append(a[0])
        return await lean_call(self, *a, **kw)

    lean_pipeline = LeanRedis.pipeline

    async def counted_lean_pipeline(self, commands):
        if self.client is redis:
            sent.append(len(commands))
        return await lean_pipeline(self, commands)

    monkeypatch.setattr(LeanRedis, "call", counted_lean)
    monkeypatch.setattr(LeanRedis, "pipeline", counted_lean_pipeline)
    return sent
