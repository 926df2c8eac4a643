"""Which ways a tensor can take between processes on this host, and the memory the agent's
pool is made of.

The paths, fastest first where the host offers them:
- ``cuda-ipc``: a consumer on the same host and GPU opens the owner's GPU copy (device→device).
- ``nixl-vram``: NIXL/UCX reading GPU memory directly. Only worth it where UCX has a GPU
  transport (cuda_ipc, RDMA/GDR); on a host without one UCX emulates it over TCP loopback,
  ~100× slower than staging (DESIGN.md "GPU facts"). The agent does not register VRAM: the
  doctor measures this path so an operator sees what the host offers, and staging stays the
  cross-process path until a host shows a GPU transport faster than it.
- ``staging``: device→pinned host pool→NIXL DRAM READ→pinned pool→device; always works, also
  across hosts; the only path for CPU-only workers (plain host pool, no pinning).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["pool_buffer", "describe_paths"]

_PAGE = 4096


def pool_buffer(pool_bytes: int, device: torch.device) -> torch.Tensor:
    """The agent's uint8 pool, page aligned: pinned (page-locked, so device copies run at full
    speed and need no bounce buffer) when the agent's device is a GPU, plain memory otherwise."""
    if device.type == "cuda":
        return torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=True)  # cudaHostAlloc: page aligned
    raw = np.empty(pool_bytes + _PAGE, dtype=np.uint8)  # over-allocate a page, slice to align
    skew = (-raw.ctypes.data) % _PAGE
    return torch.from_numpy(raw[skew: skew + pool_bytes])


def describe_paths(device: torch.device, pool_bytes: int, ipc: bool) -> str:
    """One log line: which paths this agent offers and uses."""
    mib = pool_bytes >> 20
    if device.type != "cuda":
        return f"transfer paths: staging over NIXL DRAM (host pool {mib} MiB, CPU tensors)"
    from shared.device import device_uuid

    ipc_part = (f"cuda-ipc for consumers on this host and GPU {device_uuid(device)}" if ipc
                else "cuda-ipc off (setting transfer_cuda_ipc)")
    return (f"transfer paths on {device}: {ipc_part}; staging device->pinned pool ({mib} MiB)->NIXL DRAM->"
            f"pinned->device for every other consumer; nixl-vram not registered (`mmfleet doctor` measures it)")
