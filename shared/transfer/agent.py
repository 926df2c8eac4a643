"""One NIXL agent per process: a leased tensor pool that peers READ from.

Contracts:
- The agent owns ONE page-aligned uint8 pool of ``pool_bytes``, registered with NIXL (DRAM,
  UCX) exactly once. ``put`` copies a CPU tensor into a slot and leases it; the returned
  :class:`TensorRef` names the raw ``(addr, nbytes, device_id)`` descriptor plus the lease.
  A lease ends when a consumer releases it (NIXL notification ``b"rel:<id>,<id>..."``), on
  ``free_local``, or when ``lease_ttl_ms`` passes. Release of an unknown lease is ignored.
- ``get`` pulls a peer's slot into a private staging slot of this pool (one-sided READ), then
  copies it into a NEW tensor the caller owns. Any failure to pull (peer SIGKILLed, peer
  unreachable, timeout, NIXL error state) raises :class:`OwnerGoneError`; callers treat it
  as "recompute from the source". A READ of an already-expired lease is NOT detectable by
  the puller (one-sided): it returns whatever the slot holds now, so TTLs must exceed the
  worst consumer delay.
- Not thread-safe: every method runs on the event loop thread that called ``start``. NIXL is
  created without its progress thread (it busy-spins a core); the ``start``-ed progress task
  drives notifications and lease expiry instead, and it must be running for peers' READs of
  this pool to complete.
- Blocking calls: ``add_remote_agent`` (first contact with a peer) connects eagerly, ~10 ms;
  a loopback DRAM READ copies inside ``transfer()`` (UCX cma), ~0.1 ms per MiB.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import Iterable

import numpy as np
import torch
try:  # the meta package's import path, else the variant wheel the project pins
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

from shared import metrics
from shared.protocol import AgentRef, TensorRef
from shared.transfer.pool import SlotAllocator

__all__ = ["TransferAgent", "TransferError", "PoolFullError", "OwnerGoneError", "DTYPES"]

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_PAGE = 4096
_REL_PREFIX = b"rel:"
_REL_CHUNK = 512  # lease ids per notification, keeps each message small
_SPIN_S = 0.0002  # yield-only polling window of a pull before timed sleeps
_COUNTERS = (
    "puts", "local_gets", "transfers", "bytes_pulled", "transfer_errors", "expired_leases",
    "released_leases", "release_notifs_sent", "release_notifs_received", "quarantined_bytes",
)


class TransferError(Exception):
    """Base class of transfer failures."""


class PoolFullError(TransferError):
    """No slot large enough is free in this process's pool (now, or within the wait)."""


class OwnerGoneError(TransferError):
    """The owner cannot serve the tensor (dead, unreachable, lease gone): recompute it."""


class TransferAgent:
    """The process's NIXL agent plus its registered tensor pool (see module contracts)."""

    def __init__(
        self, name: str, pool_bytes: int, *, lease_ttl_ms: int = 60_000,
        fast_poll_ms: float = 1.0, idle_poll_ms: float = 20.0, fast_window_ms: float = 1_000,
        xfer_timeout_ms: int = 10_000,
        align_bytes: int = 64, nixl_log_level: int | None = logging.WARNING,
    ) -> None:
        """``name`` must be unique across the fleet (e.g. stage-host-pid-random).
        ``xfer_timeout_ms`` bounds a ``get`` (staging wait + transfer) unless overridden.
        Polling is fast (``fast_poll_ms``) while a transfer is in flight or for
        ``fast_window_ms`` after a ``put``: an owner's progress is needed only while a NEW peer
        connects (its first READ), and a consumer usually reads within that window. Polling
        every 1 ms for a lease's whole life cost ~10 % of a core per process, measured here.
        ``nixl_log_level``: nixl's Python logger prints INFO lines to *stdout*; this sets
        the ``nixl`` logger's level (``None`` leaves it alone)."""
        if pool_bytes <= 0:
            raise ValueError("pool_bytes must be > 0")
        if nixl_log_level is not None:
            logging.getLogger("nixl").setLevel(nixl_log_level)
        self.name = name
        self.pool_bytes = pool_bytes
        self._ttl_s = lease_ttl_ms / 1000.0
        self._fast_s = fast_poll_ms / 1000.0
        self._idle_s = idle_poll_ms / 1000.0
        self._fast_window_s = fast_window_ms / 1000.0
        self._last_put = float("-inf")
        self._xfer_timeout_ms = xfer_timeout_ms
        # Over-allocate by a page and slice so the registered region starts page aligned.
        raw = np.empty(pool_bytes + _PAGE, dtype=np.uint8)
        skew = (-raw.ctypes.data) % _PAGE
        self._buf = raw[skew : skew + pool_bytes]
        self._tbuf = torch.from_numpy(self._buf)  # uint8 view for dtype-agnostic copies
        self._base = int(self._buf.ctypes.data)
        self._alloc = SlotAllocator(pool_bytes, align_bytes)
        self._nixl = nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        self._reg = self._nixl.register_memory(
            np.array([[self._base, pool_bytes, 0]], dtype=np.uint64), "DRAM"
        )
        self._metadata: bytes = self._nixl.get_agent_metadata()
        # lease id -> (offset, expires_at); insertion order == expiry order (one TTL), and
        # OrderedDict keeps popping from the front O(1).
        self._leases: collections.OrderedDict[int, tuple[int, float]] = collections.OrderedDict()
        self._next_lease = 1
        self._remotes: dict[str, bytes] = {}  # peer name -> metadata loaded into NIXL
        self._peer_inflight: dict[str, int] = {}
        self._inflight = 0
        self._space_event: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._sleeper: asyncio.Future[None] | None = None
        self._quarantine: set[int] = set()  # staging offsets NIXL may still write
        self._closed = False
        self._c = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Launch the progress task (idempotent). Raises after ``stop``."""
        self._check_open()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._progress_loop(), name=f"nixl-progress-{self.name}"
            )

    async def stop(self) -> None:
        """Stop progress, deregister the pool and drop the NIXL agent (idempotent, final)."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        try:
            self._nixl.deregister_memory(self._reg)
        except Exception as e:  # teardown is best-effort
            log.warning("nixl deregister_memory failed for %s: %s", self.name, e)
        self._nixl = None  # type: ignore[assignment]  # drops the agent and its UCX resources

    async def __aenter__(self) -> "TransferAgent":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def ref(self) -> AgentRef:
        """What a peer needs to pull from this agent (name + ~0.5 KiB NIXL metadata)."""
        return AgentRef(self.name, self._metadata)

    # ------------------------------------------------------------ owner side

    def put(self, tensor: torch.Tensor) -> TensorRef:
        """Copy a CPU tensor into a new leased slot; raises :class:`PoolFullError`."""
        src, dtype_name = self._as_bytes(tensor)
        off = self._alloc.alloc(src.numel())
        if off is None:
            raise self._full(src.numel())
        return self._lease(off, src, dtype_name, tuple(tensor.shape))

    async def put_wait(self, tensor: torch.Tensor, timeout_ms: float) -> TensorRef:
        """``put``, waiting up to ``timeout_ms`` for room; then raises :class:`PoolFullError`."""
        src, dtype_name = self._as_bytes(tensor)
        off = await self._alloc_wait(src.numel(), time.monotonic() + timeout_ms / 1000.0)
        return self._lease(off, src, dtype_name, tuple(tensor.shape))

    def free_local(self, lease: int) -> bool:
        """End a lease held by this agent; returns False if it was unknown/expired."""
        entry = self._leases.pop(lease, None)
        if entry is not None:
            self._free_slot(entry[0])
        return entry is not None

    # ------------------------------------------------------------ consumer side

    async def get(
        self, owner: AgentRef, ref: TensorRef, *, timeout_ms: float | None = None
    ) -> torch.Tensor:
        """Pull ``ref`` into a new caller-owned CPU tensor (``ref.dtype`` / ``ref.shape``).

        Local refs are copied without NIXL. Raises :class:`OwnerGoneError` if the owner
        cannot serve it within ``timeout_ms`` (default ``xfer_timeout_ms``), and
        :class:`PoolFullError` if no staging slot frees up in time."""
        dtype = self._check_ref(ref)
        if ref.agent != owner.name:
            raise ValueError(f"ref names agent {ref.agent!r} but owner is {owner.name!r}")
        if ref.agent == self.name:
            return self._get_local(ref, dtype)
        self._check_open()
        tmo = self._xfer_timeout_ms if timeout_ms is None else timeout_ms
        deadline = time.monotonic() + tmo / 1000.0
        peer = owner.name
        self._inflight += 1
        self._peer_inflight[peer] = self._peer_inflight.get(peer, 0) + 1
        self._kick()  # a transfer in flight switches progress to fast polling
        failed = False
        try:
            off = await self._alloc_wait(ref.nbytes, deadline)
            try:
                t0 = time.perf_counter()
                await self._read_into(owner, ref, off, deadline)
                metrics.NIXL_TRANSFER.observe(time.perf_counter() - t0)
                out = self._tbuf[off : off + ref.nbytes].clone()
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
                    self._forget_peer(peer)
        self._c["transfers"] += 1
        self._c["bytes_pulled"] += ref.nbytes
        metrics.NIXL_BYTES.labels("in").inc(ref.nbytes)
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
        try:
            self._check_open()
            if isinstance(owner, AgentRef):
                self._ensure_peer(owner)
            elif name not in self._remotes:
                log.warning("release to unknown peer %s (no metadata): dropped", name)
                return
            for i in range(0, len(leases), _REL_CHUNK):
                ids = b",".join(b"%d" % int(x) for x in leases[i : i + _REL_CHUNK])
                self._nixl.send_notif(name, _REL_PREFIX + ids)
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
            "leases_outstanding": len(self._leases), "inflight": self._inflight,
            "remote_agents": len(self._remotes), **self._c,
        }

    # ------------------------------------------------------------ internals: slots, leases

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.name} is stopped")

    def _as_bytes(self, tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
        if tensor.device.type != "cpu":
            raise ValueError(f"put needs a CPU tensor, got {tensor.device}")
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            raise ValueError(f"unsupported dtype {tensor.dtype}; supported: {list(DTYPES)}")
        return tensor.detach().contiguous().reshape(-1).view(torch.uint8), name

    def _lease(self, off: int, src: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> TensorRef:
        n = src.numel()
        self._tbuf[off : off + n].copy_(src)
        lease = self._next_lease
        self._next_lease += 1
        self._last_put = time.monotonic()
        self._leases[lease] = (off, self._last_put + self._ttl_s)
        self._c["puts"] += 1
        metrics.NIXL_BYTES.labels("out").inc(n)
        self._kick()  # a fresh lease switches progress to fast polling
        return TensorRef(self.name, self._base + off, n, 0, lease, dtype, shape)

    def _check_ref(self, ref: TensorRef) -> torch.dtype:
        dtype = DTYPES.get(ref.dtype)
        if dtype is None:
            raise ValueError(f"unsupported dtype {ref.dtype!r}")
        if math.prod(ref.shape) * dtype.itemsize != ref.nbytes:
            raise ValueError(f"ref nbytes {ref.nbytes} != shape {ref.shape} x {ref.dtype}")
        return dtype

    def _get_local(self, ref: TensorRef, dtype: torch.dtype) -> torch.Tensor:
        off = ref.addr - self._base
        entry = self._leases.get(ref.lease)
        if entry is None or entry[0] != off:
            raise OwnerGoneError(f"{self.name}: local lease {ref.lease} expired or unknown")
        self._c["local_gets"] += 1
        return self._tbuf[off : off + ref.nbytes].clone().view(dtype).reshape(ref.shape)

    async def _alloc_wait(self, nbytes: int, deadline: float) -> int:
        if self._alloc.reserved_size(nbytes) > self.pool_bytes:
            raise PoolFullError(f"{self.name}: {nbytes} B exceeds the pool ({self.pool_bytes} B)")
        while (off := self._alloc.alloc(nbytes)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._full(nbytes)
            if self._space_event is None:
                self._space_event = asyncio.Event()
            try:
                await asyncio.wait_for(self._space_event.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return off

    def _full(self, nbytes: int) -> PoolFullError:
        a = self._alloc
        return PoolFullError(
            f"{self.name}: no slot for {nbytes} B (free {a.free_bytes}, largest {a.largest_free})"
        )

    def _free_slot(self, off: int) -> None:
        self._alloc.free(off)
        ev, self._space_event = self._space_event, None
        if ev is not None:
            ev.set()  # wakes every waiter; each retries its own alloc

    def _expire(self, now: float) -> None:
        leases = self._leases
        while leases:
            lease, (off, expires) = next(iter(leases.items()))
            if expires > now:
                break
            del leases[lease]
            self._free_slot(off)
            self._c["expired_leases"] += 1

    # ------------------------------------------------------------ internals: NIXL

    async def _read_into(self, owner: AgentRef, ref: TensorRef, off: int, deadline: float) -> None:
        """One NIXL READ of ``ref`` into local offset ``off``; OwnerGoneError on failure."""
        nx = self._nixl
        handle = None
        try:
            self._ensure_peer(owner)
            local = nx.get_xfer_descs([(self._base + off, ref.nbytes, 0)], "DRAM")
            remote = nx.get_xfer_descs([(ref.addr, ref.nbytes, ref.device_id)], "DRAM")
            handle = nx.initialize_xfer("READ", local, remote, owner.name, b"")
            state = nx.transfer(handle)
            spin_until = time.monotonic() + _SPIN_S
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError("transfer timed out")
                # Warm pulls finish in microseconds: yield only; then back off to timed
                # sleeps so a slow (first-connect) pull does not spin the loop.
                await asyncio.sleep(0 if now < spin_until else self._fast_s)
                state = nx.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
        except asyncio.CancelledError:
            self._release_handle(handle, off)
            raise
        except Exception as e:
            self._release_handle(handle, off)
            raise OwnerGoneError(
                f"{self.name}: cannot pull lease {ref.lease} ({ref.nbytes} B) from "
                f"{owner.name}: {type(e).__name__}: {e}"
            ) from e
        self._release_handle(handle, off)

    def _release_handle(self, handle: object, off: int) -> None:
        if handle is None:
            return
        try:
            handle.release()  # type: ignore[attr-defined]
        except Exception as e:
            # NIXL could not cancel an active READ: the staging bytes may still be written,
            # so they are never reused (quarantined for the process lifetime).
            log.error("%s: xfer handle release failed, quarantining slot: %s", self.name, e)
            self._quarantine.add(off)
            self._c["quarantined_bytes"] += self._alloc.size_of(off)

    def _ensure_peer(self, owner: AgentRef) -> None:
        if self._remotes.get(owner.name) == owner.metadata:
            return
        loaded = self._nixl.add_remote_agent(owner.metadata)
        # 1.5.1 returns the name as bytes; a mismatch means the ref lies about its owner.
        loaded_s = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_s != owner.name:
            raise ValueError(f"metadata is for agent {loaded_s!r}, not {owner.name!r}")
        self._remotes[owner.name] = owner.metadata

    def _forget_peer(self, name: str) -> None:
        """Drop a failed peer once nothing pulls from it: frees its endpoint, and a later
        pull reloads it instead of reusing a dead connection."""
        if self._remotes.pop(name, None) is not None:
            try:
                self._nixl.remove_remote_agent(name)
            except Exception as e:
                log.debug("remove_remote_agent(%s): %s", name, e)

    def _kick(self) -> None:
        """Cut the progress loop's sleep short (new lease / transfer started)."""
        s = self._sleeper
        if s is not None and not s.done():
            s.set_result(None)

    def _handle_notif(self, peer: str, msg: bytes) -> None:
        if not msg.startswith(_REL_PREFIX):
            log.debug("%s: ignoring notification from %s: %r", self.name, peer, msg[:32])
            return
        self._c["release_notifs_received"] += 1
        for part in msg[len(_REL_PREFIX) :].split(b","):
            try:
                lease = int(part)
            except ValueError:
                log.warning("%s: malformed release from %s: %r", self.name, peer, msg[:64])
                return
            if self.free_local(lease):
                self._c["released_leases"] += 1

    async def _progress_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                for peer, msgs in self._nixl.get_new_notifs().items():
                    for msg in msgs:
                        self._handle_notif(peer, msg)
            except Exception as e:  # one bad poll must not kill progress
                log.warning("%s: notification poll failed: %s", self.name, e)
            self._expire(time.monotonic())
            now = time.monotonic()
            busy = self._inflight > 0 or (bool(self._leases) and now - self._last_put < self._fast_window_s)
            # A plain future + timer (not asyncio.sleep) so _kick can end the sleep early.
            fut: asyncio.Future[None] = loop.create_future()
            self._sleeper = fut
            timer = loop.call_later(
                self._fast_s if busy else self._idle_s, lambda: fut.done() or fut.set_result(None)
            )
            try:
                await fut
            finally:
                timer.cancel()
                self._sleeper = None
