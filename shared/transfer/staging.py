"""Asynchronous device→pinned staging of a GPU tensor (:class:`Stager`), and the word that says
how far it got. A GPU owner's ``put`` queues its device→host copy in chunks on a copy stream of
its own; the slot's *staging word* (16 bytes after the data) is ``(stamp, chunks done)``, written
``(stamp, 0)`` by the host before the ref exists and then by the stream after each chunk, so a
count of ``k`` proves those bytes are in host memory. A same-host GPU consumer copies each chunk
as it lands; a NIXL consumer READs the data once every chunk is done. A word of another stamp
means the slot was freed and reused. CPU tensors are copied synchronously (``stamp == 0``).

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable

import torch

__all__ = ["word_offset", "slot_bytes", "chunk_bytes_for", "n_chunks", "chunks_done", "read_word", "wait_chunks",
           "Stager"]

WORD_BYTES = 16
_MIN_CHUNK = 4 << 20
_MAX_CHUNKS = 8  # each chunk costs two copy launches (~10 µs); 8 keeps the pipeline's tail at 1/8


def word_offset(nbytes: int) -> int:
    """The staging word's offset from the slot's start (8-byte aligned, after the data)."""
    return (nbytes + 7) & ~7


def slot_bytes(nbytes: int) -> int:
    """Bytes a staged tensor of ``nbytes`` takes in a pool: data, padding, word."""
    return word_offset(nbytes) + WORD_BYTES


def chunk_bytes_for(nbytes: int) -> int:
    """Chunk size: an eighth of the tensor, at least 4 MiB, 64 KiB aligned."""
    return max(_MIN_CHUNK, (-(-nbytes // _MAX_CHUNKS) + 0xFFFF) & ~0xFFFF)


def n_chunks(nbytes: int, chunk: int) -> int:
    return max(1, -(-nbytes // chunk))


def chunks_done(word: tuple[int, int], stamp: int) -> int:
    """How many chunks the word says are in host memory; -1 if it is another put's word."""
    return word[1] if word[0] == stamp else -1


def read_word(buf, offset: int) -> tuple[int, int]:
    """The word at ``offset`` of a buffer (an mmap, a numpy array), read afresh."""
    return struct.unpack_from("<qq", buf, offset)


def wait_chunks(read: Callable[[], tuple[int, int]], stamp: int, need: int, deadline: float) -> None:
    """Block until the word says ``need`` chunks are done. RuntimeError if the slot holds
    another put (freed and reused) or the deadline (``time.monotonic()``) passes first."""
    spins = 0
    while True:
        done = chunks_done(read(), stamp)
        if done >= need:
            return
        if done < 0:
            raise RuntimeError("the slot holds another tensor now (its lease is gone)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"staging not done: {done}/{need} chunks by the deadline")
        spins += 1
        if spins > 3000:  # a chunk in flight lands within ~0.7 ms (32 MiB); past that, do not burn a core
            time.sleep(50e-6)


class Stager:
    """The owner's copy stream into its pinned pool (``pool``: uint8, page-locked).

    ``stage(off, src, into)`` returns ``(stamp, chunk_bytes)``. It copies ``src`` on the
    caller's stream into ``into`` (the slot of a GPU pool) or a clone that it keeps until the
    copy is done, so the caller may reuse ``src`` at once; the first chunk's word therefore
    also proves that device copy done. ``wait(off)`` blocks until a
    slot's copy is done; ``settle()`` forgets finished copies (call it now and then);
    ``drop(off)`` waits, then forgets (a slot must not be reused while a copy may write it)."""

    def __init__(self, pool: torch.Tensor, device: torch.device) -> None:
        self._pool = pool
        self._words = pool.numpy()  # the host's view, for the word's first value
        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._stamp = random.getrandbits(62) + 1
        counts = torch.arange(64, dtype=torch.int64, device=device)
        self._counts = [c.view(torch.uint8) for c in counts.split(1)]  # the words' counts, made once
        self._pending: dict[int, tuple[torch.cuda.Event, torch.Tensor]] = {}

    def stage(self, off: int, src: torch.Tensor, into: torch.Tensor | None = None) -> tuple[int, int]:
        n = src.numel()
        self._stamp += 1
        stamp, chunk = self._stamp, chunk_bytes_for(n)
        w = off + word_offset(n)
        struct.pack_into("<qq", self._words, w, stamp, 0 if n else 1)  # before any copy can land
        # a private GPU copy (the caller may reuse src at once), on the caller's stream
        held = src.clone() if into is None else into.copy_(src)
        s = self._stream
        s.wait_stream(torch.cuda.current_stream(self._device))
        count = self._pool[w + 8: w + 16]
        with torch.cuda.stream(s):
            for i, (dst, part) in enumerate(zip(self._pool[off: off + n].split(chunk), held.split(chunk))):
                dst.copy_(part, non_blocking=True)
                count.copy_(self._counts[i + 1], non_blocking=True)
            done = torch.cuda.Event()
            done.record(s)
        # held stays referenced until ``done`` (no record_stream: torch frees a block
        # with recorded streams through events, which fails if that happens at interpreter exit)
        self._pending[off] = (done, held)
        return stamp, chunk

    def wait(self, off: int) -> None:
        entry = self._pending.get(off)
        if entry is not None:
            entry[0].synchronize()

    def settle(self) -> None:
        for off in [o for o, (done, _) in self._pending.items() if done.query()]:
            del self._pending[off]

    def drop(self, off: int) -> None:
        self.wait(off)
        self._pending.pop(off, None)

    def close(self) -> None:
        self._stream.synchronize()
        self._pending.clear()
