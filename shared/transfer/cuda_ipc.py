"""CUDA IPC between processes of one host: a GPU agent's GPU pool (the device twin of its pinned
pool, same slot offsets) exported once (:func:`export`) as the raw fields of torch's
``UntypedStorage._share_cuda_()`` in a msgspec :class:`~shared.protocol.CudaIpcHandle` (no
pickle); each ref names its slot by ``slot_offset``. A consumer opens a peer's pool once (~0.3 ms)
and keeps it open (:class:`IpcPeers`, LRU-bounded), so a pull is one device copy. Any CUDA
failure raises :class:`IpcError` and callers fall back to the host paths.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import collections

import torch

from shared.process.device import device_uuid, host_id, local_index
from shared.protocol import CudaIpcHandle

__all__ = ["IpcError", "export", "can_open", "IpcPeers"]


class IpcError(Exception):
    """The handle could not be opened or copied here."""


def export(t: torch.Tensor) -> CudaIpcHandle:
    """``t`` must own its whole storage (a fresh ``empty``); the exporter keeps it for its life
    (the transfer agent's GPU pool)."""
    if t.device.type != "cuda" or t.storage_offset() != 0 or not t.is_contiguous():
        raise ValueError("export needs a contiguous CUDA tensor that starts its storage")
    storage = t.untyped_storage()
    _dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
    return CudaIpcHandle(host=host_id(), device_uuid=device_uuid(t.device), handle=bytes(handle),
                         storage_bytes=int(size), offset_bytes=int(offset), ref_counter_handle=bytes(rc_handle),
                         ref_counter_offset=int(rc_offset), event_handle=bytes(ev_handle or b""),
                         event_sync_required=bool(ev_sync))


def can_open(h: CudaIpcHandle) -> bool:
    """True only on the exporter's host with the exporter's GPU visible here."""
    return h.host == host_id() and local_index(h.device_uuid) is not None


class IpcPeers:
    """A consumer's open peer pools, LRU-bounded."""

    def __init__(self, max_open: int = 16) -> None:
        self._max = max_open
        self._open: collections.OrderedDict[str, torch.UntypedStorage] = collections.OrderedDict()

    def copy(self, owner: str, h: CudaIpcHandle, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...],
             device: torch.device | None = None, sync: bool = True) -> torch.Tensor:
        """A new tensor with the slot's bytes, on ``device`` (default: the exporter's GPU here).
        ``sync=False``: return with the copy queued on the current stream (the caller must not
        let the slot go before it is done). The slot's bytes must be complete: the caller checks
        the owner's staging word first (:mod:`shared.transfer.staging`)."""
        index = local_index(h.device_uuid)
        if h.host != host_id() or index is None:
            raise IpcError(f"handle of {h.host} GPU {h.device_uuid} cannot be opened here")
        if h.slot_offset + nbytes > h.storage_bytes:
            raise IpcError(f"{nbytes} B at {h.slot_offset} asked of a {h.storage_bytes} B storage")
        key = f"{owner}\n{h.handle.hex()}"  # a later process may reuse a dead owner's handle bytes
        try:
            with torch.cuda.device(index):
                storage = self._open.get(key)
                if storage is None:
                    storage = torch.UntypedStorage._new_shared_cuda(
                        index, h.handle, h.storage_bytes, h.offset_bytes, h.ref_counter_handle,
                        h.ref_counter_offset, h.event_handle or None, h.event_sync_required)
                    self._open[key] = storage
                    while len(self._open) > self._max:
                        self._open.popitem(last=False)
                self._open.move_to_end(key)
                src = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(
                    storage, h.slot_offset, (nbytes,), (1,))
                out = torch.empty(nbytes, dtype=torch.uint8, device=device or torch.device("cuda", index))
                out.copy_(src, non_blocking=True)
                if sync:
                    torch.cuda.current_stream().synchronize()
        except (RuntimeError, TypeError) as exc:
            self._open.pop(key, None)
            raise IpcError(f"CUDA IPC open/copy failed: {exc}") from exc
        return out.view(dtype).reshape(shape)

    def close(self) -> None:
        self._open.clear()
