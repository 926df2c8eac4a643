"""One NIXL agent per process (:class:`TransferAgent`): a leased tensor pool that peers READ from.
``put`` copies a tensor into a leased slot of the pool and returns a :class:`TensorRef`; ``get``
pulls a peer's slot into a new tensor the caller owns (one-sided READ, or a faster same-host path,
:mod:`shared.transfer.paths`); a consumer's ``release``, or the lease's TTL, frees the slot. Any
failure to pull raises :class:`OwnerGoneError`: "recompute from the source". Not thread-safe:
every method runs on the event loop thread that called ``start``.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable

import msgspec
import numpy as np
import torch

from shared import metrics
from shared.process.aio import wait_event
from shared.protocol import AgentRef, TensorRef
from shared.transfer.leases import SlotHolders
from shared.transfer.nixl_thread import make_agent
from shared.transfer.paths import DevicePaths
from shared.transfer.peers import Peers
from shared.transfer.pool import SlotAllocator
from shared.transfer.progress import IDLE_POLL_MS, Progress, release_ids, release_notifs
from shared.transfer.staging import read_word, slot_bytes, word_offset
from shared.transfer.tensors import DTYPES, OwnerGoneError, PoolFullError, TransferError, as_bytes, check_ref

__all__ = ["TransferAgent", "TransferError", "PoolFullError", "OwnerGoneError", "DTYPES"]

log = logging.getLogger(__name__)

_COUNTERS = (
    "puts", "local_gets", "transfers", "bytes_pulled", "transfer_errors", "expired_leases",
    "released_leases", "release_notifs_sent", "release_notifs_received", "quarantined_bytes",
)


def _slot_bytes(src: torch.Tensor) -> int:
    """A GPU tensor's slot also holds its staging word."""
    return slot_bytes(src.numel()) if src.is_cuda else src.numel()


class TransferAgent:
    """The process's NIXL agent plus its registered tensor pool.

    - ONE page-aligned uint8 pool of ``pool_bytes``, registered with NIXL (DRAM, UCX) once. A
      ref names the raw ``(addr, nbytes, device_id)`` descriptor plus the lease. A lease ends when
      a consumer releases it (NIXL notification ``b"rel:<id>,<id>..."``), on ``free_local``, or
      when ``lease_ttl_ms`` passes; release of an unknown lease is ignored. A READ of an expired
      CPU lease is NOT detectable by the puller (one-sided), so TTLs must exceed the worst
      consumer delay.
    - Pins (for caches): ``pin(ref)`` holds a slot without a TTL until ``unpin(ref)``; ``share``
      gives another consumer its own lease on a held slot. A slot is freed only when its last
      holder goes (:class:`~shared.transfer.leases.SlotHolders`). A ref with ``lease == 0`` names
      a pinned slot without holding it: a remote reader must validate it some other way (the
      embedding index).
    - ``get`` READs into a private staging slot, then copies into a NEW tensor; a CPU tensor put
      with ``keep_source=True`` is handed as it is to this process's own ``get`` of that slot.
    - GPUs (:class:`~shared.transfer.paths.DevicePaths`): the pool is pinned host memory; ``put``
      of a CUDA tensor starts its device→pinned copy without waiting (consumers wait on the slot's
      staging word, :mod:`shared.transfer.staging`) and, with ``cuda_ipc``, copies it into the GPU
      pool that same-GPU consumers open. A ref marked ``on_device`` arrives on the consumer's GPU
      (in host memory where it has none); ``release`` waits for a copy still in flight.
    - NIXL's own progress thread (``progress_wake_ms`` > 0) sleeps on UCX's event fd and serves
      peers' READs (:mod:`shared.transfer.nixl_thread`); the ``start``-ed progress task handles
      notifications and lease expiry (and, with no thread, must also drive NIXL).
    - Blocking calls: first contact with a peer connects eagerly (~10 ms); a loopback DRAM READ
      copies inside ``transfer()`` (UCX cma), ~0.1 ms per MiB."""

    def __init__(
        self, name: str, pool_bytes: int, *, lease_ttl_ms: int = 60_000,
        fast_poll_ms: float = 1.0, idle_poll_ms: float = IDLE_POLL_MS, fast_window_ms: float = 1_000,
        xfer_timeout_ms: int = 10_000, progress_wake_ms: int = 100,
        align_bytes: int = 64, nixl_log_level: int | None = logging.WARNING, host: str = "",
        device: str | torch.device = "cpu", cuda_ipc: bool = True, shared_pool: bool = True,
    ) -> None:
        """``name`` must be unique across the fleet (e.g. stage-host-pid-random).
        ``xfer_timeout_ms`` bounds a ``get`` (staging wait + transfer) unless overridden.
        ``progress_wake_ms`` > 0: NIXL's event-driven progress thread serves peers' READs, so
        Python polls fast (``fast_poll_ms``) only while a transfer is in flight or a slot is
        awaited. 0: no thread; Python polling drives NIXL too, so it is also fast for
        ``fast_window_ms`` after a ``put`` (a peer's READ waits for the owner's progress on
        this host); polling every 1 ms for a lease's whole life cost ~10 % of a core.
        ``nixl_log_level``: nixl's Python logger prints INFO lines to *stdout*; this sets
        the ``nixl`` logger's level (``None`` leaves it alone). ``host``: this process's
        advertised host, carried in :meth:`ref`; READs from a peer with another host are
        counted in ``mmfleet_nixl_cross_host_bytes_total``. ``shared_pool`` (CPU agents; a GPU
        agent's pool is always shared): the pool is a memfd that consumers on this host map and
        copy from instead of a NIXL READ (:mod:`shared.transfer.host_shm`); False: NIXL only,
        both ways."""
        if pool_bytes <= 0:
            raise ValueError("pool_bytes must be > 0")
        if nixl_log_level is not None:
            logging.getLogger("nixl").setLevel(nixl_log_level)
        self.name = name
        self.host = host
        self.pool_bytes = pool_bytes
        self._ttl_s = lease_ttl_ms / 1000.0
        self._fast_window_s = fast_window_ms / 1000.0
        self._last_put = float("-inf")
        self._xfer_timeout_ms = xfer_timeout_ms
        self._c = dict.fromkeys(_COUNTERS, 0)
        self._dev = DevicePaths(name, pool_bytes, torch.device(device), cuda_ipc, self._c, shared_pool)
        self._tbuf = self._dev.pool  # uint8, page aligned; pinned and shared on a GPU
        self._base = int(self._tbuf.data_ptr())
        self._alloc = SlotAllocator(pool_bytes, align_bytes)
        self._nixl, threaded = make_agent(name, wake_ms=progress_wake_ms)
        if threaded:  # the thread serves peers' READs: no need to poll fast after a put
            self._fast_window_s = 0.0
        self._reg = self._nixl.register_memory(
            np.array([[self._base, pool_bytes, 0]], dtype=np.uint64), "DRAM"
        )
        self._metadata: bytes = self._nixl.get_agent_metadata()
        self._leases = SlotHolders(self._ttl_s)
        self._peers = Peers(self._nixl, name)
        self._peer_inflight: dict[str, int] = {}
        self._inflight = 0
        self._space_event: asyncio.Event | None = None
        self._progress = Progress(name, self._poll, self._busy, fast_s=fast_poll_ms / 1000.0,
                                  idle_s=idle_poll_ms / 1000.0)
        self._quarantine: set[int] = set()  # staging offsets NIXL may still write
        self._sources: dict[int, torch.Tensor] = {}  # slot -> the bytes put with keep_source
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Launch the progress task (idempotent). Raises after ``stop``."""
        self._check_open()
        self._progress.start()

    async def stop(self) -> None:
        """Stop progress, deregister the pool and drop the NIXL agent (idempotent, final)."""
        if self._closed:
            return
        self._closed = True
        await self._progress.stop()
        try:
            self._nixl.deregister_memory(self._reg)
        except Exception as e:  # teardown is best-effort
            log.warning("nixl deregister_memory failed for %s: %s", self.name, e)
        self._nixl = None  # type: ignore[assignment]  # drops the agent and its UCX resources
        self._dev.close()

    async def __aenter__(self) -> "TransferAgent":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def ref(self) -> AgentRef:
        """What a peer needs to pull from this agent (name + ~0.5 KiB NIXL metadata)."""
        return AgentRef(self.name, self._metadata, self.host)

    # ------------------------------------------------------------ owner side

    def put(self, tensor: torch.Tensor) -> TensorRef:
        """Copy a CPU tensor into a new leased slot; raises :class:`PoolFullError`."""
        src, dtype_name = as_bytes(tensor)
        off = self._alloc.alloc(_slot_bytes(src))
        if off is None:
            raise self._full(_slot_bytes(src))
        return self._lease(off, src, dtype_name, tuple(tensor.shape))

    async def put_wait(self, tensor: torch.Tensor, timeout_ms: float, *, keep_source: bool = False) -> TensorRef:
        """``put``, waiting up to ``timeout_ms`` for room; then raises :class:`PoolFullError`.
        ``keep_source``: the caller will not write ``tensor`` again, and a local ``get`` of the
        slot may return it instead of a copy (a stage handing its output to a stage of this
        process: a copy of the slot, and its fresh pages, saved per get)."""
        src, dtype_name = as_bytes(tensor)
        off = await self._alloc_wait(_slot_bytes(src), time.monotonic() + timeout_ms / 1000.0)
        ref = self._lease(off, src, dtype_name, tuple(tensor.shape))
        if keep_source and not src.is_cuda:
            self._sources[off] = src
        return ref

    def free_local(self, lease: int) -> bool:
        """End a lease held by this agent; returns False if it was unknown/expired."""
        known, off = self._leases.end(lease)
        if off is not None:
            self._free_slot(off)
        return known

    def pin(self, ref: TensorRef) -> None:
        """Hold ``ref``'s slot (one of this agent's, still leased) until ``unpin``."""
        self._leases.pin(self._own_offset(ref))

    def unpin(self, ref: TensorRef) -> None:
        """Drop the pin; the slot is freed once no lease on it is left either."""
        off = self._leases.unpin(self._own_offset(ref))
        if off is not None:
            self._free_slot(off)

    def share(self, ref: TensorRef) -> TensorRef:
        """A new lease on ``ref``'s held slot (a cache hit handed to one more consumer)."""
        off = self._own_offset(ref)
        if not self._leases.is_held(off):
            raise KeyError(f"{self.name}: slot at {ref.addr:#x} is not held")
        lease = self._leases.lease(off, time.monotonic())
        self._last_put = time.monotonic()
        self._kick()
        return msgspec.structs.replace(ref, lease=lease)

    # ------------------------------------------------------------ consumer side

    async def get(
        self, owner: AgentRef, ref: TensorRef, *, timeout_ms: float | None = None
    ) -> torch.Tensor:
        """Pull ``ref`` into a new caller-owned CPU tensor (``ref.dtype`` / ``ref.shape``).

        Local refs are copied without NIXL (a slot put with ``keep_source``: that very tensor,
        read-only). Raises :class:`OwnerGoneError` if the owner
        cannot serve it within ``timeout_ms`` (default ``xfer_timeout_ms``), and
        :class:`PoolFullError` if no staging slot frees up in time."""
        dtype = check_ref(ref)
        if ref.agent != owner.name:
            raise ValueError(f"ref names agent {ref.agent!r} but owner is {owner.name!r}")
        if ref.agent == self.name:
            return self._get_local(ref, dtype)
        self._check_open()
        t_fast = time.perf_counter()
        if (fast := self._dev.pull(ref, dtype)) is not None:  # CUDA IPC / a shared pool of this host
            metrics.NIXL_TRANSFER.observe(time.perf_counter() - t_fast)  # a pull, whatever the path
            metrics.NIXL_BYTES.labels("in").inc(ref.nbytes)
            return fast
        tmo = self._xfer_timeout_ms if timeout_ms is None else timeout_ms
        deadline = time.monotonic() + tmo / 1000.0
        peer = owner.name
        self._inflight += 1
        self._peer_inflight[peer] = self._peer_inflight.get(peer, 0) + 1
        self._kick()  # a transfer in flight switches progress to fast polling
        failed = False
        try:
            off = await self._alloc_wait(slot_bytes(ref.nbytes) if ref.stamp else ref.nbytes, deadline)
            try:
                t0 = time.perf_counter()
                if ref.stamp:  # a GPU owner's copy into its slot may still be running
                    w = self._base + off + word_offset(ref.nbytes)
                    await self._peers.await_staged(owner, ref, w, lambda: read_word(self._tbuf.numpy(), w - self._base),
                                                   deadline, self._progress.fast_s, lambda: self._quarantine_slot(off))
                await self._peers.read(owner, ref, self._base + off, deadline, self._progress.fast_s,
                                       lambda: self._quarantine_slot(off))
                metrics.NIXL_TRANSFER.observe(time.perf_counter() - t0)
                out = self._dev.from_pool(off, ref)
            finally:
                if off not in self._quarantine:
                    self._free_slot(off)
        except OwnerGoneError:
            failed = True
            self._c["transfer_errors"] += 1
            raise
        finally:
            self._inflight -= 1
            self._peer_inflight[peer] -= 1
            if self._peer_inflight[peer] == 0:
                del self._peer_inflight[peer]
                if failed:
                    self._peers.forget(peer)
        self._c["transfers"] += 1
        self._c["bytes_pulled"] += ref.nbytes
        metrics.NIXL_BYTES.labels("in").inc(ref.nbytes)
        if owner.host and owner.host != self.host:
            metrics.NIXL_CROSS_HOST_BYTES.labels(owner.host).inc(ref.nbytes)
        return out.view(dtype).reshape(ref.shape)

    async def get_many(
        self, pairs: Iterable[tuple[AgentRef, TensorRef]], *, timeout_ms: float | None = None
    ) -> list[torch.Tensor]:
        """Concurrent ``get`` of every pair, in order; raises the first failure once all
        pulls have settled (so no staging slot is left mid-transfer)."""
        results = await asyncio.gather(
            *(self.get(o, r, timeout_ms=timeout_ms) for o, r in pairs), return_exceptions=True
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]

    async def release(self, owner: AgentRef | str, leases: list[int]) -> None:
        """Tell ``owner`` its slots ``leases`` may be reused. Best-effort: a dead or unknown
        owner is logged, never raised (its leases die with it or expire)."""
        name = owner if isinstance(owner, str) else owner.name
        if not leases:
            return
        if name == self.name:
            for lease in leases:
                self.free_local(lease)
            return
        await self._dev.reads_done(name, leases)  # our device copies out of those slots first
        try:
            self._check_open()
            if isinstance(owner, AgentRef):
                self._peers.ensure(owner)
            elif name not in self._peers:
                log.warning("release to unknown peer %s (no metadata): dropped", name)
                return
            for notif in release_notifs(leases):
                self._nixl.send_notif(name, notif)
                self._c["release_notifs_sent"] += 1
        except Exception as e:
            log.warning("release of %d leases to %s failed (owner gone?): %s", len(leases), name, e)
        self._kick()  # one prompt progress poll helps the notification leave

    def stats(self) -> dict[str, int]:
        """Counters and pool gauges (all ints)."""
        a = self._alloc
        return {
            "pool_bytes": self.pool_bytes, "used_bytes": a.used_bytes,
            "free_bytes": a.free_bytes, "largest_free": a.largest_free,
            "leases_outstanding": len(self._leases), "pinned_slots": self._leases.pinned,
            "inflight": self._inflight,
            "remote_agents": len(self._peers), **self._c,
        }

    # ------------------------------------------------------------ internals: slots, leases

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.name} is stopped")

    def _own_offset(self, ref: TensorRef) -> int:
        off = ref.addr - self._base
        if ref.agent != self.name or not 0 <= off < self.pool_bytes:
            raise ValueError(f"{self.name}: ref of {ref.agent} at {ref.addr:#x} is not in this pool")
        return off

    def _lease(self, off: int, src: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> TensorRef:
        n = src.numel()
        if src.is_cuda:  # device→pinned in chunks behind us; CUDA IPC handle, shared-pool name
            gpu_fields = self._dev.stage(off, src)
        else:
            self._tbuf[off : off + n].copy_(src)
            gpu_fields = self._dev.host_fields(off)
        self._last_put = time.monotonic()
        lease = self._leases.lease(off, self._last_put)
        self._c["puts"] += 1
        metrics.NIXL_BYTES.labels("out").inc(n)
        self._kick()  # a fresh lease switches progress to fast polling
        return TensorRef(self.name, self._base + off, n, 0, lease, dtype, shape, **gpu_fields)

    def _get_local(self, ref: TensorRef, dtype: torch.dtype) -> torch.Tensor:
        off = ref.addr - self._base
        held = self._leases.is_pinned(off) if ref.lease == 0 else self._leases.offset_of(ref.lease) == off
        if not held:
            raise OwnerGoneError(f"{self.name}: local lease {ref.lease} expired or unknown (or unpinned)")
        self._c["local_gets"] += 1
        src = self._sources.get(off)  # put with keep_source: read-only on both sides
        out = src if src is not None else self._dev.from_pool(off, ref, local=True)
        return out.view(dtype).reshape(ref.shape)

    async def _alloc_wait(self, nbytes: int, deadline: float) -> int:
        if self._alloc.reserved_size(nbytes) > self.pool_bytes:
            raise PoolFullError(f"{self.name}: {nbytes} B exceeds the pool ({self.pool_bytes} B)")
        while (off := self._alloc.alloc(nbytes)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._full(nbytes)
            if self._space_event is None:
                self._space_event = asyncio.Event()
            await wait_event(self._space_event, remaining)
        return off

    def _full(self, nbytes: int) -> PoolFullError:
        a = self._alloc
        return PoolFullError(
            f"{self.name}: no slot for {nbytes} B (free {a.free_bytes}, largest {a.largest_free})"
        )

    def _free_slot(self, off: int) -> None:
        self._sources.pop(off, None)
        self._alloc.free(off)
        self._dev.drop(off)
        ev, self._space_event = self._space_event, None
        if ev is not None:
            ev.set()  # wakes every waiter; each retries its own alloc

    def _expire(self, now: float) -> None:
        n, freed = self._leases.expire(now)
        self._c["expired_leases"] += n
        for off in freed:
            self._free_slot(off)

    # ------------------------------------------------------------ internals: NIXL

    def _quarantine_slot(self, off: int) -> None:
        # NIXL could not cancel an active READ: the staging bytes may still be written, so
        # they are never reused (quarantined for the process lifetime).
        self._quarantine.add(off)
        self._c["quarantined_bytes"] += self._alloc.size_of(off)

    def _kick(self) -> None:
        """Cut the progress task's sleep short (new lease / transfer started)."""
        self._progress.kick()

    def _handle_notif(self, peer: str, msg: bytes) -> None:
        leases = release_ids(msg)
        if leases is None:
            log.debug("%s: ignoring notification from %s: %r", self.name, peer, msg[:32])
            return
        self._c["release_notifs_received"] += 1
        try:
            for lease in leases:
                if self.free_local(lease):
                    self._c["released_leases"] += 1
        except ValueError:
            log.warning("%s: malformed release from %s: %r", self.name, peer, msg[:64])

    def _poll(self) -> None:
        try:
            for peer, msgs in self._nixl.get_new_notifs().items():
                for msg in msgs:
                    self._handle_notif(peer, msg)
        except Exception as e:  # one bad poll must not kill progress
            log.warning("%s: notification poll failed: %s", self.name, e)
        self._dev.settle()
        self._expire(time.monotonic())

    def _busy(self) -> bool:
        """Poll fast while a transfer is in flight, a slot is awaited (releases free it), or
        shortly after a put (see ``__init__``)."""
        return (self._inflight > 0 or self._space_event is not None
                or (bool(self._leases) and time.monotonic() - self._last_put < self._fast_window_s))
