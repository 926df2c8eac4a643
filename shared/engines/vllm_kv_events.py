"""vLLM's KV cache events, translated into the fleet's block keys (:mod:`shared.kv.blocks`), so
the routing table keeps speaking our content hashes where vLLM's prefix cache replaces ours. The
engine core publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` on a zmq ``ipc://``
socket of this process; :class:`EventSubscriber` reads them in the worker's event loop and
:class:`BlockTranslator` maps each vLLM block to our keys. Nothing here publishes to Kafka: the
engine hands the changes back with each prefill (``PrefillOutput.kv_changes``) and the prefill
handler gives them to the worker's routing-table writer, as the transformers path does.

Design: docs/design/kv-routing.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Sequence

from shared.kv.prefix_cache import CacheChanges

log = logging.getLogger(__name__)

CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention wants block sizes that are multiples of 32


def vllm_block_size(kv_block_size: int) -> int:
    """vLLM's KV block size for a fleet hashing blocks of ``kv_block_size`` positions: the
    smallest multiple of both 32 and ``kv_block_size`` (32 for the default 16)."""
    if kv_block_size <= 0:
        raise ValueError(f"kv_block_size must be positive, got {kv_block_size}")
    return math.lcm(CPU_BLOCK_MULTIPLE, kv_block_size)


def ipc_endpoint() -> str:
    """A fresh ``ipc://`` path for one engine's event socket (no port to collide with)."""
    return f"ipc://{tempfile.gettempdir()}/mmfleet-kvev-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def events_config(endpoint: str, hwm: int = 10_000):
    """vLLM's ``KVEventsConfig``: zmq publisher bound at ``endpoint``, bounded queues, no replay."""
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=None,
                          buffer_steps=1, hwm=hwm, max_queue_size=hwm, topic="")


class BlockTranslator:
    """vLLM block events → changes in our keys. One event loop.

    - Every vLLM request carries ``session_id`` = a key of ours, which vLLM stamps on each
      ``BlockStored`` of that request (the blocks it computed). Before submitting, the engine
      registers the prompt's block hashes under that key (:meth:`register`, computed with the
      router's function, so they are exactly the router's).
    - vLLM's block size is a multiple ``ratio`` of ours (:func:`vllm_block_size`): vLLM block ``i``
      (its index along the chain: 0 when ``parent_block_hash`` is None, else the parent's + 1)
      covers our blocks ``i*r .. i*r+r-1``. Blocks past the registered prompt map to nothing.
    - The same key of ours may stand behind several vLLM blocks: keys are reference-counted,
      stored when the first vLLM block holding them appears, removed when the last goes.
    - Bounded: at most ``max_blocks`` vLLM blocks (past it the oldest are forgotten with a
      warning), ``max_sessions`` registrations, and ``max_pending`` keys of changes not yet
      taken; beyond that they collapse into one resync (``cleared`` + every key held), which is
      exact. A gap in vLLM's sequence numbers (its PUB socket dropped batches at its high-water
      mark) is logged: the table may then list blocks vLLM no longer holds (lost hits, never
      wrong output)."""

    def __init__(self, ratio: int, *, max_blocks: int = 1 << 17, max_sessions: int = 1024,
                 max_pending: int = 1 << 16) -> None:
        if ratio < 1:
            raise ValueError(f"ratio (vLLM block size / ours) must be >= 1, got {ratio}")
        self.ratio = ratio
        self._max_blocks = max_blocks
        self._max_sessions = max_sessions
        self._max_pending = max_pending
        self._sessions: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # key -> our prompt hashes
        self._blocks: OrderedDict[object, tuple[int, tuple[int, ...]]] = OrderedDict()  # vLLM hash -> (index, ours)
        self._refs: dict[int, int] = {}  # our key -> vLLM blocks holding it
        self._stored: dict[int, None] = {}  # pending changes, in order (dicts: ordered sets)
        self._removed: dict[int, None] = {}
        self._cleared = False
        self._waiters: dict[str, list[tuple[int, asyncio.Future]]] = {}
        self.unmatched = 0  # stored blocks we could not place (unknown session or parent)

    # ------------------------------------------------------------------ requests
    def register(self, session: str, hashes: Sequence[int]) -> None:
        self._sessions[session] = tuple(hashes)
        self._sessions.move_to_end(session)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)

    async def wait_stored(self, session: str, n_blocks: int, timeout_s: float) -> bool:
        """Until the keys of ``session``'s first ``n_blocks`` vLLM blocks are all held (blocks it
        computed reported stored, blocks it reused stored before), or ``timeout_s`` passes
        (False). vLLM sends events on their own socket: they may trail the request's output."""
        if n_blocks <= 0 or self.held_blocks(session) >= n_blocks:
            return True
        fut = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(session, []).append((n_blocks, fut))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return False
        finally:
            left = [(n, f) for n, f in self._waiters.get(session, []) if f is not fut]
            if left:
                self._waiters[session] = left
            else:
                self._waiters.pop(session, None)

    def held_blocks(self, session: str) -> int:
        """How many of ``session``'s leading vLLM blocks have every key held."""
        ours, r, n = self._sessions.get(session, ()), self.ratio, 0
        while (n + 1) * r <= len(ours) and all(k in self._refs for k in ours[n * r:(n + 1) * r]):
            n += 1
        return n

    def take(self) -> CacheChanges:
        """The changes since the last call, net: a key both stored and removed meanwhile is
        reported as what it is now (held: stored; gone: removed)."""
        changes = CacheChanges(stored=[k for k in self._stored if k in self._refs],
                               removed=[k for k in self._removed if k not in self._refs], cleared=self._cleared)
        self._stored, self._removed, self._cleared = {}, {}, False
        return changes

    def held(self) -> set[int]:
        return set(self._refs)

    # ------------------------------------------------------------------ events
    def apply(self, events: Sequence) -> None:
        """One vLLM ``KVEventBatch``'s events (``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``), dispatched by class name so this needs no vLLM import."""
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                self._on_stored(ev)
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    self._drop(h)
            elif kind == "AllBlocksCleared":
                self._blocks.clear()
                self._refs.clear()
                self._stored, self._removed, self._cleared = {}, {}, True
        if len(self._stored) + len(self._removed) > self._max_pending:
            log.warning("kv events: %d changes not taken; resynchronising the table (cleared + %d held keys)",
                        len(self._stored) + len(self._removed), len(self._refs))
            self._stored, self._removed, self._cleared = dict.fromkeys(self._refs), {}, True

    def _on_stored(self, ev) -> None:
        session = getattr(ev, "session_id", None)
        ours = self._sessions.get(session) if session is not None else None
        if ev.parent_block_hash is None:
            index = 0
        else:
            parent = self._blocks.get(ev.parent_block_hash)
            index = parent[0] + 1 if parent is not None else None
        if ours is None or index is None:
            self.unmatched += len(ev.block_hashes)
            return
        r = self.ratio
        for i, h in enumerate(ev.block_hashes):
            at = index + i
            keys = tuple(ours[at * r:(at + 1) * r])
            if len(keys) < r:  # past the registered prompt (decode tokens): not routed on
                keys = ()
            if h not in self._blocks:
                self._blocks[h] = (at, keys)
                for k in keys:
                    self._refs[k] = self._refs.get(k, 0) + 1
                    if self._refs[k] == 1:
                        self._stored[k] = None
            else:
                self._blocks.move_to_end(h)
        while len(self._blocks) > self._max_blocks:
            old = next(iter(self._blocks))
            log.warning("kv events: more than %d vLLM blocks tracked; forgetting the oldest", self._max_blocks)
            self._drop(old)
        for waiting in list(self._waiters):
            self._wake(waiting)

    def _drop(self, h) -> None:
        entry = self._blocks.pop(h, None)
        if entry is None:
            return
        for k in entry[1]:
            n = self._refs.get(k, 0) - 1
            if n > 0:
                self._refs[k] = n
                continue
            self._refs.pop(k, None)
            self._removed[k] = None

    def _wake(self, session: str) -> None:
        held = self.held_blocks(session)
        for n, fut in self._waiters.get(session, []):
            if held >= n and not fut.done():
                fut.set_result(True)


class EventSubscriber:
    """Reads one engine's event socket into a :class:`BlockTranslator` (a task of the worker's
    loop). zmq bounds what waits unread (``hwm`` messages); a decode error or a sequence gap is
    logged and the loop goes on; :meth:`stop` is idempotent."""

    def __init__(self, endpoint: str, translator: BlockTranslator, *, hwm: int = 10_000) -> None:
        self.endpoint = endpoint
        self.translator = translator
        self._hwm = hwm
        self._ctx = None
        self._sock = None
        self._task: asyncio.Task | None = None
        self._next_seq: int | None = None
        self.batches = 0
        self.gaps = 0

    def start(self) -> None:
        """Connect (before the engine binds: zmq connects when the path appears) and read."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, self._hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-kv-events")

    async def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3:
                log.warning("kv events: unexpected message of %d frames skipped", len(frames))
                continue
            _topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if self._next_seq is not None and seq != self._next_seq:
                self.gaps += 1
                log.warning("kv events: sequence gap (%d expected, %d received): vLLM dropped event batches; "
                            "the routing table may list blocks it evicted", self._next_seq, seq)
            self._next_seq = seq + 1
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError as exc:
                log.warning("kv events: undecodable batch %d skipped: %r", seq, exc)
                continue
            self.translator.apply(batch.events)
            self.batches += 1

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        path = self.endpoint.removeprefix("ipc://")
        if path != self.endpoint:
            with contextlib.suppress(OSError):
                os.unlink(path)

    async def changes_after(self, session: str, n_blocks: int, timeout_s: float) -> CacheChanges:
        """The changes to report with a prefill, once ``n_blocks`` of its own blocks were seen
        (or ``timeout_s`` passed: logged, the table then learns of them with a later report)."""
        if not await self.translator.wait_stored(session, n_blocks, timeout_s):
            failed = self.failed()
            if failed is not None:
                raise RuntimeError(f"the vLLM kv-event reader died: {failed!r}") from failed
            log.warning("kv events: %d of %d block events of %s not in after %.1f s; the routing table learns "
                        "of them with a later prefill", n_blocks - self.translator.held_blocks(session), n_blocks,
                        session, timeout_s)
        return self.translator.take()

    def failed(self) -> BaseException | None:
        """The reader's exception if it ended by one (it should not end while running)."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            return self._task.exception()
        return None

