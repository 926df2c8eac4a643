"""Who holds a slot of the registered pool (:class:`SlotHolders`): leases (numbered, each ending
on release or after ``ttl_s``) and at most one pin (held by a cache until it unpins). A slot
stays allocated while it has a holder; only when the last goes is its offset handed back to free
(each mutating call returns the offsets that became free). So a consumer's release never ends a
cache's pin, and an evicted slot stays intact until every lease on it has ended. Lease ids are
unique and never 0 (0 means "no lease" in a ``TensorRef``). Pure Python, not thread-safe.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import collections

__all__ = ["SlotHolders"]


class SlotHolders:
    """Leases and pins over pool offsets (see module contracts)."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        # lease id -> (offset, expires_at); insertion order == expiry order (one TTL), so
        # expiry pops from the front in O(1)
        self._leases: collections.OrderedDict[int, tuple[int, float]] = collections.OrderedDict()
        self._holders: dict[int, int] = {}  # offset -> leases + pin on it
        self._pinned: set[int] = set()
        self._next = 1

    def __len__(self) -> int:
        """Outstanding leases (pins not counted)."""
        return len(self._leases)

    @property
    def pinned(self) -> int:
        return len(self._pinned)

    def lease(self, off: int, now: float) -> int:
        """A new lease on ``off`` (a fresh slot or one already held); returns its id."""
        lease = self._next
        self._next += 1
        self._leases[lease] = (off, now + self._ttl_s)
        self._holders[off] = self._holders.get(off, 0) + 1
        return lease

    def offset_of(self, lease: int) -> int | None:
        entry = self._leases.get(lease)
        return None if entry is None else entry[0]

    def is_held(self, off: int) -> bool:
        return off in self._holders

    def is_pinned(self, off: int) -> bool:
        return off in self._pinned

    def end(self, lease: int) -> tuple[bool, int | None]:
        """End ``lease``: (was it known, the offset to free now or None)."""
        entry = self._leases.pop(lease, None)
        if entry is None:
            return False, None
        return True, self._drop(entry[0])

    def pin(self, off: int) -> None:
        """Hold ``off`` until ``unpin``; the slot must be held already (by the put's lease)."""
        if off not in self._holders:
            raise KeyError(f"offset {off} is not held: pin it while its lease is live")
        if off not in self._pinned:
            self._pinned.add(off)
            self._holders[off] += 1

    def unpin(self, off: int) -> int | None:
        """Drop the pin on ``off``; returns ``off`` if that freed it (no lease left)."""
        if off not in self._pinned:
            return None
        self._pinned.discard(off)
        return self._drop(off)

    def expire(self, now: float) -> tuple[int, list[int]]:
        """End every lease past its TTL: (leases expired, offsets to free)."""
        leases, freed, n = self._leases, [], 0
        while leases:
            lease, (off, expires) = next(iter(leases.items()))
            if expires > now:
                break
            del leases[lease]
            n += 1
            done = self._drop(off)
            if done is not None:
                freed.append(done)
        return n, freed

    def _drop(self, off: int) -> int | None:
        left = self._holders[off] - 1
        if left:
            self._holders[off] = left
            return None
        del self._holders[off]
        return off
