"""Which ways a tensor can take between processes on this host (:class:`DevicePaths`), and the
memory the agent's pool is made of. Fastest first where the host offers them: ``cuda-ipc`` (same
host and GPU: device→device), ``shm-staging`` (device→pinned memfd pool→device, the consumer
following the owner's chunks), ``host-shm`` (a CPU tensor: one copy out of the owner's mapped
pool), ``staging`` (device→pinned pool→NIXL DRAM READ→device: always works, across hosts too).
``nixl-vram`` (UCX reading GPU memory) is measured by the doctor but not used: without a GPU
transport UCX emulates it over TCP loopback, ~100× slower than staging.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import numpy as np
import torch

from shared.protocol import TensorRef
from shared.transfer import cuda_ipc
from shared.transfer.staging import Stager

__all__ = ["pool_buffer", "describe_paths", "DevicePaths"]

log = logging.getLogger(__name__)

_PAGE = 4096


def pool_buffer(pool_bytes: int, device: torch.device, shared: bool = True):
    """The agent's uint8 pool, page aligned, and its :class:`SharedPool` (``None`` when not
    shared): a memfd mapping that consumers on this host map, page-locked when the agent's
    device is a GPU (device copies run at pinned speed; always shared there); plain memory on a
    CPU agent with ``shared`` off."""
    if device.type == "cuda" or shared:
        from shared.transfer.host_shm import SharedPool

        pool = SharedPool(pool_bytes, pinned=device.type == "cuda")
        return pool.tensor, pool
    raw = np.empty(pool_bytes + _PAGE, dtype=np.uint8)  # over-allocate a page, slice to align
    skew = (-raw.ctypes.data) % _PAGE
    return torch.from_numpy(raw[skew: skew + pool_bytes]), None


def describe_paths(device: torch.device, pool_bytes: int, ipc: bool, shared: bool = True) -> str:
    """One log line: which paths this agent offers and uses."""
    mib = pool_bytes >> 20
    if device.type != "cuda":
        if not shared:
            return f"transfer paths: staging over NIXL DRAM (host pool {mib} MiB, CPU tensors; transfer_host_shm off)"
        return (f"transfer paths: host-shm (shared host pool {mib} MiB, mapped by consumers on this host); "
                f"NIXL DRAM READ for consumers on other hosts")
    from shared.process.device import device_uuid

    ipc_part = (f"cuda-ipc (GPU pool {mib} MiB, exported once) for consumers on this host and GPU "
                f"{device_uuid(device)}" if ipc
                else "cuda-ipc off (setting transfer_cuda_ipc)")
    return (f"transfer paths on {device}: {ipc_part}; shm-staging (device->shared pinned pool {mib} MiB->device) "
            f"for GPU consumers on this host; staging over NIXL DRAM for every other consumer; nixl-vram not "
            f"registered (`mmfleet doctor` measures it)")


class DevicePaths:
    """The device side of one :class:`~shared.transfer.TransferAgent`: its pool (pinned and
    shared on a GPU), the GPU copies it offers by CUDA IPC, the peers' pools it maps, and the
    fast pulls (CUDA IPC, then the shared pinned pool) tried before the NIXL path."""

    def __init__(self, name: str, pool_bytes: int, device: torch.device, ipc: bool, counters: dict[str, int],
                 shared: bool = True) -> None:
        from shared.transfer.host_shm import PeerPools

        self.name, self.device = name, device
        self.ipc = ipc and device.type == "cuda"
        gpu = device.type == "cuda"
        self.pool, self._shm = pool_buffer(pool_bytes, device, shared)
        self._stager = Stager(self.pool, device) if gpu else None
        self._peer_pools = PeerPools() if self._shm is not None else None
        # the GPU twin of the pool (same slot offsets), exported once: a put is a device copy
        # into it, and a consumer on this GPU keeps it open (no export or open per tensor)
        self._gpu_pool = torch.empty(pool_bytes, dtype=torch.uint8, device=device) if self.ipc else None
        self._pool_ipc = cuda_ipc.export(self._gpu_pool) if self.ipc else None
        self._ipc_peers = cuda_ipc.IpcPeers() if self.ipc else None
        self._reads: dict[tuple[str, int], torch.cuda.Event] = {}  # (owner, lease): our copy out of its slot
        self._c = counters
        counters.update(dict.fromkeys(("ipc_gets", "ipc_failures", "shm_gets", "shm_failures"), 0))
        log.info("%s: %s", name, describe_paths(device, pool_bytes, self.ipc, self._shm is not None))

    def host_fields(self, off: int) -> dict:
        """The ref fields of a CPU tensor put into slot ``off`` (copied before the ref leaves)."""
        return {"host_shm": self._shm.ref(off)} if self._shm is not None else {}

    def stage(self, off: int, src: torch.Tensor) -> dict:
        """Start the device→pinned copy of a CUDA tensor into slot ``off`` (not waited for: see
        :mod:`shared.transfer.staging`) and, with CUDA IPC, its copy into the GPU pool; the ref
        fields for it. An agent without a GPU copies it synchronously (its pool is not pinned)."""
        if self._stager is None:
            self.pool[off: off + src.numel()].copy_(src)
            return {"on_device": True}
        into = self._gpu_pool[off: off + src.numel()] if self._gpu_pool is not None else None
        stamp, chunk = self._stager.stage(off, src, into)
        ipc = msgspec.structs.replace(self._pool_ipc, slot_offset=off) if self._pool_ipc is not None else None
        return {"on_device": True, "cuda_ipc": ipc, "host_shm": self._shm.ref(off), "stamp": stamp,
                "chunk_bytes": chunk}

    def pull(self, ref: TensorRef, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor by CUDA IPC or from the owner's shared pool; ``None``: use NIXL."""
        if not (self._peer_pools is not None and self._peer_pools.usable(ref.host_shm)):
            return None
        to_gpu = ref.on_device and self.device.type == "cuda"
        if not to_gpu and ref.stamp:  # a GPU owner's copy into the slot may still run: NIXL reads its word
            return None
        # a host tensor is copied out at once; to a GPU, a leased slot stays the owner's until we
        # release it, so the copy need not be waited for here (``reads_done`` waits before the
        # release); a lease-free ref (a pinned cache slot) could go at any time: that copy is waited for
        sync = not to_gpu or ref.lease == 0
        if to_gpu and ref.cuda_ipc is not None and self.ipc and cuda_ipc.can_open(ref.cuda_ipc):
            try:
                if ref.stamp:  # a staged chunk proves the owner's device copy into its GPU pool is done
                    self._peer_pools.wait(ref.agent, ref.host_shm, ref.nbytes, ref.stamp, 1)
                out = self._ipc_peers.copy(ref.agent, ref.cuda_ipc, ref.nbytes, dtype, ref.shape, self.device, sync)
                self._c["ipc_gets"] += 1
                return self._reading(ref, out, sync)
            except (cuda_ipc.IpcError, OSError, RuntimeError) as exc:
                self._c["ipc_failures"] += 1
                log.warning("%s: CUDA IPC from %s failed, trying the next path: %s", self.name, ref.agent, exc)
        try:
            out = self._peer_pools.copy_to(ref.agent, ref.host_shm, ref.nbytes,
                                           self.device if to_gpu else torch.device("cpu"), ref.stamp,
                                           ref.chunk_bytes, sync=sync)
            self._c["shm_gets"] += 1
            return self._reading(ref, out.view(dtype).reshape(ref.shape), sync)
        except (OSError, RuntimeError) as exc:
            self._c["shm_failures"] += 1
            # a host pull's usual failure is an owner that exited (the NIXL path reports it gone)
            log.log(logging.WARNING if to_gpu else logging.DEBUG, "%s: pool of %s not mapped, pulling over NIXL: %s",
                    self.name, ref.agent, exc)
        return None

    def _reading(self, ref: TensorRef, out: torch.Tensor, sync: bool) -> torch.Tensor:
        """Remember the copy out of ``ref``'s slot still in flight (stream-ordered for the caller)."""
        if not sync:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._reads[(ref.agent, ref.lease)] = done
        return out

    async def reads_done(self, owner: str, leases: list[int]) -> None:
        """Wait until no copy out of these leases' slots is in flight (before they go back)."""
        for lease in leases:
            done = self._reads.pop((owner, lease), None)
            while done is not None and not done.query():
                await asyncio.sleep(0.0005)

    def from_pool(self, off: int, ref: TensorRef, local: bool = False) -> torch.Tensor:
        """A new uint8 tensor with the slot's bytes: on this GPU if the ref's tensor was on a GPU
        and this agent has one (pinned→device, or this agent's own GPU copy), else host memory."""
        if local and ref.on_device and self._gpu_pool is not None:
            return self._gpu_pool[off: off + ref.nbytes].clone()  # stream-ordered after the put's copy
        if local and self._stager is not None:
            self._stager.wait(off)  # our own copy into the slot may still be in flight
        src = self.pool[off: off + ref.nbytes]
        if ref.on_device and self.device.type == "cuda":
            return torch.empty(ref.nbytes, dtype=torch.uint8, device=self.device).copy_(src)
        return src.clone()

    def drop(self, off: int) -> None:
        """The slot is being freed: wait for a copy out of it still in flight."""
        if self._stager is not None:
            self._stager.drop(off)

    def settle(self) -> None:
        if self._stager is not None:
            self._stager.settle()
        for key in [k for k, done in self._reads.items() if done.query()]:
            del self._reads[key]

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
        if self._reads:  # copies out of peers' pools must end before those are unmapped
            torch.cuda.synchronize(self.device)
            self._reads.clear()
        if self._ipc_peers is not None:
            self._ipc_peers.close()
        self._gpu_pool = None
        if self._peer_pools is not None:
            self._peer_pools.close()
            self._shm.close()
