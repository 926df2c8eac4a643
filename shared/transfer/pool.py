"""Offset allocator for one contiguous, pre-registered memory region (:class:`SlotAllocator`):
byte offsets into ``capacity_bytes``, never touching memory (pure Python, testable without NIXL).
Offsets and slot sizes are multiples of ``align_bytes`` (a 0-byte request still takes one unit);
first-fit over a free list sorted by offset, coalescing on free, so ``used_bytes + free_bytes ==
capacity_bytes``. Freeing an offset not allocated raises ``KeyError``: accepting it would hide a
lease-accounting bug that later hands the same bytes to two tensors. Not thread-safe.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import bisect

__all__ = ["SlotAllocator"]


class SlotAllocator:
    """First-fit free-list allocator with coalescing over ``[0, capacity_bytes)``."""

    def __init__(self, capacity_bytes: int, align_bytes: int = 64) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if align_bytes <= 0 or align_bytes & (align_bytes - 1):
            raise ValueError(f"align_bytes must be a power of two, got {align_bytes}")
        self._capacity = capacity_bytes
        self._align = align_bytes
        # Parallel sorted lists of free block starts and sizes (bisect on starts).
        self._free_starts: list[int] = [0]
        self._free_sizes: list[int] = [capacity_bytes]
        self._allocated: dict[int, int] = {}  # offset -> reserved size
        self._used = 0

    # ------------------------------------------------------------ queries

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def align_bytes(self) -> int:
        return self._align

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by live slots (including alignment padding)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def largest_free(self) -> int:
        """Size of the largest free block: the biggest request that can succeed now
        (before rounding; a request needs ``round_up(nbytes) <= largest_free``)."""
        return max(self._free_sizes, default=0)

    @property
    def n_allocated(self) -> int:
        return len(self._allocated)

    def size_of(self, offset: int) -> int:
        """Reserved size of the live slot at ``offset`` (``KeyError`` if not allocated)."""
        return self._allocated[offset]

    def reserved_size(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` actually reserves."""
        n = max(nbytes, 1)
        return (n + self._align - 1) & ~(self._align - 1)

    def free_blocks(self) -> list[tuple[int, int]]:
        """Snapshot of ``(offset, size)`` free blocks in offset order (for tests/debug)."""
        return list(zip(self._free_starts, self._free_sizes))

    def allocated_blocks(self) -> list[tuple[int, int]]:
        """Snapshot of ``(offset, size)`` live slots in offset order (for tests/debug)."""
        return sorted(self._allocated.items())

    # ------------------------------------------------------------ mutation

    def alloc(self, nbytes: int) -> int | None:
        """Reserve a slot of at least ``nbytes``; return its offset, or ``None`` if no free
        block is large enough (the caller decides whether to wait or fail)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        need = self.reserved_size(nbytes)
        for i, size in enumerate(self._free_sizes):
            if size < need:
                continue
            start = self._free_starts[i]
            if size == need:
                del self._free_starts[i]
                del self._free_sizes[i]
            else:
                # Take the front of the block: starts stay aligned because every
                # reservation is a multiple of the alignment and the region starts at 0.
                self._free_starts[i] = start + need
                self._free_sizes[i] = size - need
            self._allocated[start] = need
            self._used += need
            return start
        return None

    def free(self, offset: int) -> None:
        """Return the slot at ``offset``; raises ``KeyError`` on double free / unknown offset."""
        try:
            size = self._allocated.pop(offset)
        except KeyError:
            raise KeyError(f"offset {offset} is not allocated (double free?)") from None
        self._used -= size
        starts, sizes = self._free_starts, self._free_sizes
        i = bisect.bisect_left(starts, offset)
        merge_prev = i > 0 and starts[i - 1] + sizes[i - 1] == offset
        merge_next = i < len(starts) and offset + size == starts[i]
        if merge_prev and merge_next:
            sizes[i - 1] += size + sizes[i]
            del starts[i]
            del sizes[i]
        elif merge_prev:
            sizes[i - 1] += size
        elif merge_next:
            starts[i] = offset
            sizes[i] += size
        else:
            starts.insert(i, offset)
            sizes.insert(i, size)
