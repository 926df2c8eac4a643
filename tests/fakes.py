"""In-memory stand-ins for the ports a handler uses (transfer, event sink), for handler tests.
They keep the contracts the real ones keep (leases, releases, typed events) so the tests can
assert on them; the real ones are tested against real NIXL and Redis in tests/transport."""

from __future__ import annotations

import asyncio
import itertools

import torch

from shared import protocol
from shared.stage import LogLost
from shared.transfer import OwnerGoneError


class MemoryTransfer:
    """Leased tensors in a dict; several instances share ``world`` to act as separate agents."""

    def __init__(self, name: str, world: dict[str, MemoryTransfer] | None = None) -> None:
        self.name = name
        self.world = world if world is not None else {}
        self.world[name] = self
        self.slots: dict[int, torch.Tensor] = {}
        self.released: list[int] = []
        self._ids = itertools.count(1)

    def ref(self) -> protocol.AgentRef:
        return protocol.AgentRef(self.name, b"meta:" + self.name.encode())

    def put(self, tensor: torch.Tensor) -> protocol.TensorRef:
        lease = next(self._ids)
        self.slots[lease] = tensor.detach().clone().contiguous()
        return protocol.TensorRef(agent=self.name, addr=lease * 4096, nbytes=tensor.numel() * tensor.element_size(),
                                  device_id=0, lease=lease, dtype=str(tensor.dtype).removeprefix("torch."),
                                  shape=tuple(tensor.shape))

    async def put_wait(self, tensor: torch.Tensor, timeout_ms: float, *, keep_source: bool = False
                       ) -> protocol.TensorRef:
        return self.put(tensor)

    async def get(self, owner: protocol.AgentRef, ref: protocol.TensorRef) -> torch.Tensor:
        holder = self.world.get(owner.name)
        if holder is None or ref.lease not in holder.slots:
            raise OwnerGoneError(f"{owner.name} does not hold lease {ref.lease}")
        return holder.slots[ref.lease].clone()

    async def release(self, owner: protocol.AgentRef | str, leases: list[int]) -> None:
        name = owner if isinstance(owner, str) else owner.name
        holder = self.world.get(name)
        if holder is not None:
            for lease in leases:
                holder.free_local(lease)

    def free_local(self, lease: int) -> bool:
        self.released.append(lease)
        return self.slots.pop(lease, None) is not None


class ListSink:
    """Collects stream events per request."""

    def __init__(self) -> None:
        self.events: dict[str, list[protocol.StreamEvent]] = {}
        self.lost: set[str] = set()  # logs flushed away, as FLUSHALL does in Redis

    def flush(self, request_id: str) -> None:
        self.events.pop(request_id, None)
        self.lost.add(request_id)

    async def append(self, request_id: str, event: protocol.StreamEvent) -> None:
        self.events.setdefault(request_id, []).append(event)

    async def history(self, request_id: str) -> list[protocol.StreamEvent]:
        return list(self.events.get(request_id, ()))

    async def append_delta(self, request_id: str, delta: protocol.TokenDelta, position: int) -> bool:
        if request_id in self.lost:  # the counter is gone: position 0 only (RedisKeys.token_seq)
            if position > 0:
                raise LogLost(f"{request_id} flushed")
            self.lost.discard(request_id)
        written = sum(isinstance(e, protocol.TokenDelta) for e in self.events.get(request_id, ()))
        if position != written:
            return False
        await self.append(request_id, delta)
        return True

    def text(self, request_id: str) -> str:
        return "".join(e.text for e in self.events[request_id] if isinstance(e, protocol.TokenDelta))


class QueuedAppends:
    """For a ``ListSink``: ``append_delta_soon`` as Redis's sink offers it. Each append is applied
    a loop turn later (a round trip), its future's result 1 appended, 0 another writer has the
    position, 2 the log is gone. ``queued``: appends queued so far; ``in_flight_max``: the most
    of one request in flight at once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.queued = 0
        self.in_flight_max = 0
        self._flying: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()

    def append_delta_soon(self, request_id: str, delta: protocol.TokenDelta, position: int) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.queued += 1
        self._flying[request_id] = self._flying.get(request_id, 0) + 1
        self.in_flight_max = max(self.in_flight_max, self._flying[request_id])

        async def apply() -> None:
            await asyncio.sleep(0)
            try:
                res = 1 if await self.append_delta(request_id, delta, position) else 0
            except LogLost:
                res = 2
            self._flying[request_id] -= 1
            fut.set_result(res)

        task = loop.create_task(apply())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return fut


class SoonSink(QueuedAppends, ListSink):
    """A ``ListSink`` whose appends may be queued without waiting (as Redis's)."""


class AnyKey:
    """The gateway's Authenticator where every caller is let in, with no rate charged."""

    def identify(self, authorization, *, via):
        return None

    async def charge(self, key_id, *, via):
        return None
