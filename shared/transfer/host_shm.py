"""Host pools that processes of one host share: the fast lane between them. An agent's pool is a
memfd mapping registered with NIXL as DRAM (page-locked too on a GPU agent); its refs name the
memfd as ``/proc/<pid>/fd/<fd>`` plus the slot's offset (:class:`~shared.protocol.HostShm`). A
consumer on the same host maps that file once (:class:`PeerPools`) and copies slot → its own
tensor: one copy instead of a NIXL DRAM READ. Consumers on another host take the NIXL path, as
does any whose open or mapping fails or whose owner has exited. A consumer reads a slot only
while it holds the lease that names it.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import collections
import mmap
import os
import time

import torch

from shared.process.device import host_id
from shared.protocol import HostShm
from shared.transfer.staging import read_word, slot_bytes, wait_chunks, word_offset

__all__ = ["SharedPool", "PeerPools"]


def _register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel()} B failed: error {int(err)}")


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class _Mapping:
    def __init__(self, fd: int, nbytes: int, pinned: bool) -> None:
        self.fd = fd
        self.inode = os.fstat(fd).st_ino  # the pool's identity: a reused pid and fd number name another
        self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)  # page aligned: mmap
        self.pinned = False
        if pinned:
            self.pin()

    def pin(self) -> None:
        if not self.pinned:
            _register(self.tensor)
            self.pinned = True

    def close(self) -> None:
        if self.pinned:
            _unregister(self.tensor)
        del self.tensor
        try:
            self.mm.close()
        except BufferError:  # a view still exported: the mapping goes with the last view
            pass
        os.close(self.fd)


class SharedPool:
    """The owner's pool: ``tensor`` (uint8; page-locked if ``pinned``) and ``ref(offset)`` for its
    slots. Owns the memfd, the mapping and the registration until ``close``."""

    def __init__(self, nbytes: int, pinned: bool = True) -> None:
        fd = os.memfd_create("mmfleet-pool", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        self._map = _Mapping(fd, nbytes, pinned)
        self.tensor = self._map.tensor
        self._path = f"/proc/{os.getpid()}/fd/{fd}"

    def ref(self, offset: int) -> HostShm:
        return HostShm(host=host_id(), path=self._path, pool_bytes=self.tensor.numel(), offset=offset,
                       inode=self._map.inode)

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]
        self._map.close()


class PeerPools:
    """A consumer's mappings of other processes' pools, at most ``max_peers`` (least recently used
    unmapped first). A mapping is page-locked only once a copy to a GPU reads it (locking a CPU
    owner's whole pool for host copies would commit all of its memory). ``copy_to`` raises
    ``OSError`` / ``RuntimeError`` when it cannot (callers fall back)."""

    def __init__(self, max_peers: int = 16) -> None:
        self._max = max_peers
        self._maps: collections.OrderedDict[str, _Mapping] = collections.OrderedDict()

    @staticmethod
    def usable(shm: HostShm | None) -> bool:
        return shm is not None and shm.host == host_id()

    def copy_to(self, owner: str, shm: HostShm, nbytes: int, device: torch.device, stamp: int = 0,
                chunk: int = 0, wait_s: float = 1.0, sync: bool = True) -> torch.Tensor:
        """The slot's bytes in a new tensor on ``device``. ``stamp`` / ``chunk``: the slot may
        still be being staged; each chunk is copied as soon as the staging word says it landed
        (:mod:`shared.transfer.staging`), waiting at most ``wait_s`` in all. ``sync=False``:
        return with the copy queued on the current stream (the caller must not let the slot
        go before it is done)."""
        m = self._mapping(owner, shm, slot_bytes(nbytes) if stamp else nbytes)
        if device.type == "cuda":
            m.pin()  # device copies from it run at pinned speed (and may be asynchronous)
        src = m.tensor[shm.offset: shm.offset + nbytes]
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if not stamp:
            return out.copy_(src, non_blocking=not sync)
        word, deadline = shm.offset + word_offset(nbytes), time.monotonic() + wait_s
        for i, (dst, part) in enumerate(zip(out.split(chunk), src.split(chunk))):
            wait_chunks(lambda: read_word(m.mm, word), stamp, i + 1, deadline)
            dst.copy_(part, non_blocking=True)  # overlaps the owner's copy of the next chunk
        if sync:
            torch.cuda.current_stream(device).synchronize()
        return out

    def wait(self, owner: str, shm: HostShm, nbytes: int, stamp: int, need: int, wait_s: float = 1.0) -> None:
        """Block until the slot's staging word says ``need`` chunks landed (RuntimeError if the
        slot holds another tensor or ``wait_s`` passes)."""
        m = self._mapping(owner, shm, slot_bytes(nbytes))
        word = shm.offset + word_offset(nbytes)
        wait_chunks(lambda: read_word(m.mm, word), stamp, need, time.monotonic() + wait_s)

    def _mapping(self, owner: str, shm: HostShm, slot: int) -> _Mapping:
        """``owner``: the agent's name, part of the cache key (a later process may reuse a dead
        owner's pid and fd number, so the path alone does not name one pool). A mapping is used
        only while its owner still holds the file (one ``stat``): the mapping would outlive an
        exited owner, whose slots nobody vouches for, and keep its memory."""
        if shm.offset + slot > shm.pool_bytes:
            raise RuntimeError(f"slot {shm.offset}+{slot} outside a {shm.pool_bytes} B pool")
        key = f"{owner}\n{shm.path}"
        m = self._maps.get(key)
        if m is not None:
            try:
                alive = os.stat(shm.path).st_ino == m.inode
            except OSError:
                alive = False
            if not alive or m.tensor.numel() != shm.pool_bytes:
                self._drop(key)
                if not alive:
                    raise OSError(f"{owner} no longer holds {shm.path}")
                m = None
        if m is None:
            fd = os.open(shm.path, os.O_RDWR | os.O_CLOEXEC)
            try:
                if shm.inode and os.fstat(fd).st_ino != shm.inode:
                    raise OSError(f"{shm.path} is not {owner}'s pool here (another pid namespace?)")
                m = _Mapping(fd, shm.pool_bytes, pinned=False)
            except BaseException:
                os.close(fd)
                raise
            self._maps[key] = m
            while len(self._maps) > self._max:
                self._drop(next(iter(self._maps)))
        self._maps.move_to_end(key)
        return m

    def _drop(self, key: str) -> None:
        self._maps.pop(key).close()

    def close(self) -> None:
        while self._maps:
            self._drop(next(iter(self._maps)))
