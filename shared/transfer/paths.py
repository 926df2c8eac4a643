"""Which ways a tensor can take between processes on this host, and the memory the agent's
pool is made of.

The paths, fastest first where the host offers them:
- ``cuda-ipc``: a consumer on the same host and GPU opens the owner's GPU copy (device→device).
- ``nixl-vram``: NIXL/UCX reading GPU memory directly. Only worth it where UCX has a GPU
  transport (cuda_ipc, RDMA/GDR); on a host without one UCX emulates it over TCP loopback,
  ~100× slower than staging (the README, "GPUs"). The agent does not register VRAM: the
  doctor measures this path so an operator sees what the host offers, and staging stays the
  cross-process path until a host shows a GPU transport faster than it.
- ``shm-staging``: device→pinned pool→device, the pool a memfd a GPU consumer on the same host
  maps (:mod:`shared.transfer.host_shm`): one pinned copy each side, no NIXL hop.
- ``staging``: device→pinned host pool→NIXL DRAM READ→pinned pool→device; always works, also
  across hosts; the only path for CPU-only workers (plain host pool, no pinning).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from shared.protocol import TensorRef
from shared.transfer import cuda_ipc

__all__ = ["pool_buffer", "describe_paths", "DevicePaths"]

log = logging.getLogger(__name__)

_PAGE = 4096


def pool_buffer(pool_bytes: int, device: torch.device):
    """The agent's uint8 pool, page aligned, and its :class:`SharedPool` (``None`` on a CPU
    agent): a page-locked memfd mapping when the agent's device is a GPU (device copies run at
    pinned speed, and GPU consumers on this host map it), plain memory otherwise."""
    if device.type == "cuda":
        from shared.transfer.host_shm import SharedPool

        shared = SharedPool(pool_bytes)
        return shared.tensor, shared
    raw = np.empty(pool_bytes + _PAGE, dtype=np.uint8)  # over-allocate a page, slice to align
    skew = (-raw.ctypes.data) % _PAGE
    return torch.from_numpy(raw[skew: skew + pool_bytes]), None


def describe_paths(device: torch.device, pool_bytes: int, ipc: bool) -> str:
    """One log line: which paths this agent offers and uses."""
    mib = pool_bytes >> 20
    if device.type != "cuda":
        return f"transfer paths: staging over NIXL DRAM (host pool {mib} MiB, CPU tensors)"
    from shared.device import device_uuid

    ipc_part = (f"cuda-ipc for consumers on this host and GPU {device_uuid(device)}" if ipc
                else "cuda-ipc off (setting transfer_cuda_ipc)")
    return (f"transfer paths on {device}: {ipc_part}; shm-staging (device->shared pinned pool {mib} MiB->device) "
            f"for GPU consumers on this host; staging over NIXL DRAM for every other consumer; nixl-vram not "
            f"registered (`mmfleet doctor` measures it)")


class DevicePaths:
    """The device side of one :class:`~shared.transfer.TransferAgent`: its pool (pinned and
    shared on a GPU), the GPU copies it offers by CUDA IPC, the peers' pools it maps, and the
    fast pulls (CUDA IPC, then the shared pinned pool) tried before the NIXL path."""

    def __init__(self, name: str, pool_bytes: int, device: torch.device, ipc: bool, counters: dict[str, int]) -> None:
        from shared.transfer.host_shm import PeerPools

        self.name, self.device = name, device
        self.ipc = ipc and device.type == "cuda"
        self.pool, self._shm = pool_buffer(pool_bytes, device)
        self._peer_pools = PeerPools() if self._shm is not None else None
        self._copies: dict[int, torch.Tensor] = {}  # slot offset -> GPU copy offered by IPC
        self._c = counters
        counters.update(dict.fromkeys(("ipc_gets", "ipc_failures", "shm_gets", "shm_failures"), 0))
        log.info("%s: %s", name, describe_paths(device, pool_bytes, self.ipc))

    def offer(self, off: int, src: torch.Tensor) -> dict:
        """The ref fields for a slot just filled from ``src`` (holding a GPU copy for IPC)."""
        if not src.is_cuda:
            return {}
        ipc = None
        if self.ipc:
            self._copies[off] = dev = src.clone()  # own storage, lives as long as the slot
            ipc = cuda_ipc.export(dev)
        shm = self._shm.ref(off) if self._shm is not None else None
        return {"on_device": True, "cuda_ipc": ipc, "host_shm": shm}

    def pull(self, ref: TensorRef, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor by CUDA IPC or from the owner's shared pinned pool; ``None``: use NIXL."""
        if ref.cuda_ipc is not None and self.ipc and cuda_ipc.can_open(ref.cuda_ipc):
            try:
                out = cuda_ipc.open_copy(ref.cuda_ipc, ref.nbytes, dtype, ref.shape, self.device)
                self._c["ipc_gets"] += 1
                return out
            except cuda_ipc.IpcError as exc:
                self._c["ipc_failures"] += 1
                log.warning("%s: CUDA IPC from %s failed, trying the next path: %s", self.name, ref.agent, exc)
        if ref.on_device and self._peer_pools is not None and self._peer_pools.usable(ref.host_shm):
            try:
                out = self._peer_pools.copy_to(ref.agent, ref.host_shm, ref.nbytes, self.device)
                self._c["shm_gets"] += 1
                return out.view(dtype).reshape(ref.shape)
            except (OSError, RuntimeError) as exc:
                self._c["shm_failures"] += 1
                log.warning("%s: pool of %s not mapped, pulling over NIXL: %s", self.name, ref.agent, exc)
        return None

    def from_pool(self, off: int, ref: TensorRef, local: bool = False) -> torch.Tensor:
        """A new uint8 tensor with the slot's bytes: on this GPU if the ref's tensor was on a GPU
        and this agent has one (pinned→device, or this agent's own GPU copy), else host memory."""
        held = self._copies.get(off) if local else None
        if held is not None:
            return held.clone()
        src = self.pool[off: off + ref.nbytes]
        if ref.on_device and self.device.type == "cuda":
            return torch.empty(ref.nbytes, dtype=torch.uint8, device=self.device).copy_(src)
        return src.clone()

    def drop(self, off: int) -> None:
        self._copies.pop(off, None)

    def close(self) -> None:
        self._copies.clear()
        if self._peer_pools is not None:
            self._peer_pools.close()
            self._shm.close()
