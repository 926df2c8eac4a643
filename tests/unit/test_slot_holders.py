"""SlotHolders: leases and pins over pool offsets; a slot is freed only by its last holder."""

from __future__ import annotations

import pytest

from shared.transfer.leases import SlotHolders


def test_lease_then_release_frees_the_slot() -> None:
    h = SlotHolders(ttl_s=10)
    lease = h.lease(64, now=0)
    assert lease != 0 and h.offset_of(lease) == 64 and len(h) == 1
    assert h.end(lease) == (True, 64)
    assert h.end(lease) == (False, None)  # unknown now: a no-op
    assert not h.is_held(64)


def test_pinned_slot_survives_every_reader_release() -> None:
    h = SlotHolders(ttl_s=10)
    first = h.lease(0, now=0)
    h.pin(0)
    readers = [h.lease(0, now=1) for _ in range(3)]
    assert h.end(first) == (True, None)  # the producer's own lease ended: still pinned
    for r in readers:
        assert h.end(r) == (True, None)
    assert h.is_pinned(0) and h.is_held(0)
    assert h.unpin(0) == 0  # eviction with nobody reading frees it at once
    assert not h.is_held(0)


def test_unpinned_slot_waits_for_outstanding_leases() -> None:
    h = SlotHolders(ttl_s=10)
    first = h.lease(128, now=0)
    h.pin(128)
    reader = h.lease(128, now=0)
    h.end(first)
    assert h.unpin(128) is None  # evicted while a reader still holds a lease
    assert h.unpin(128) is None  # a second unpin is a no-op
    assert h.end(reader) == (True, 128)


def test_expiry_ends_leases_but_not_pins() -> None:
    h = SlotHolders(ttl_s=1)
    a = h.lease(0, now=0)
    h.pin(0)
    h.lease(64, now=0)
    h.lease(0, now=5)  # a later reader of the pinned slot
    n, freed = h.expire(now=2)
    assert n == 2 and freed == [64]
    assert h.is_held(0) and h.offset_of(a) is None
    n, freed = h.expire(now=10)
    assert n == 1 and freed == []  # the pin still holds it
    assert h.unpin(0) == 0


def test_pin_needs_a_held_slot() -> None:
    h = SlotHolders(ttl_s=1)
    with pytest.raises(KeyError):
        h.pin(0)
