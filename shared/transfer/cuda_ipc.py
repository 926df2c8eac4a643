"""CUDA IPC between processes of one host: a GPU tensor's storage exported as the raw fields of
torch's ``UntypedStorage._share_cuda_()`` in a msgspec :class:`~shared.protocol.CudaIpcHandle`
(no pickle), and opened by another process with ``UntypedStorage._new_shared_cuda``.

Contracts:
- ``export(t)`` needs ``t`` to own its whole storage (a fresh ``clone()``): the handle names the
  storage, and the exporter must keep ``t`` alive for as long as any consumer may open it (the
  transfer agent holds it under the slot's lease).
- ``can_open(h)`` is True only on the exporter's host with the exporter's GPU visible here;
  ``open_copy(h, ...)`` copies the bytes into a NEW tensor on this process's copy of that GPU
  (synchronous: the bytes are ours when it returns) and closes the mapping. Any CUDA failure
  raises ``IpcError``; callers fall back to the NIXL host path.
- torch keeps the exporter's allocation alive while an opener holds it (its ref counter), and
  caches opened allocations, so several tensors of one allocation may be opened concurrently.
"""

from __future__ import annotations

import torch

from shared.device import device_uuid, host_id, local_index
from shared.protocol import CudaIpcHandle

__all__ = ["IpcError", "export", "can_open", "open_copy"]


class IpcError(Exception):
    """The handle could not be opened or copied here."""


def export(t: torch.Tensor) -> CudaIpcHandle:
    if t.device.type != "cuda" or t.storage_offset() != 0 or not t.is_contiguous():
        raise ValueError("export needs a contiguous CUDA tensor that starts its storage")
    storage = t.untyped_storage()
    _dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
    return CudaIpcHandle(host=host_id(), device_uuid=device_uuid(t.device), handle=bytes(handle),
                         storage_bytes=int(size), offset_bytes=int(offset), ref_counter_handle=bytes(rc_handle),
                         ref_counter_offset=int(rc_offset), event_handle=bytes(ev_handle or b""),
                         event_sync_required=bool(ev_sync))


def can_open(h: CudaIpcHandle) -> bool:
    return h.host == host_id() and local_index(h.device_uuid) is not None


def open_copy(h: CudaIpcHandle, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...],
              device: torch.device | None = None) -> torch.Tensor:
    """A new tensor with the exporter's bytes, on ``device`` (default: the exporter's GPU here)."""
    index = local_index(h.device_uuid)
    if h.host != host_id() or index is None:
        raise IpcError(f"handle of {h.host} GPU {h.device_uuid} cannot be opened here")
    if nbytes > h.storage_bytes:
        raise IpcError(f"{nbytes} B asked of a {h.storage_bytes} B storage")
    try:
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(
                index, h.handle, h.storage_bytes, h.offset_bytes, h.ref_counter_handle, h.ref_counter_offset,
                h.event_handle or None, h.event_sync_required)
            src = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (nbytes,), (1,))
            out = torch.empty(nbytes, dtype=torch.uint8, device=device or torch.device("cuda", index))
            out.copy_(src)
            torch.cuda.current_stream().synchronize()  # the bytes are ours before the mapping goes
            del src, storage
    except (RuntimeError, TypeError) as exc:
        raise IpcError(f"CUDA IPC open/copy failed: {exc}") from exc
    return out.view(dtype).reshape(shape)
