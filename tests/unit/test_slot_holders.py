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


def test_stage_replicas_parse_and_apply() -> None:
    from services.modes import UnsupportedLayout, group_replicas, parse_replicas
    from shared.settings import from_env

    s = from_env({"MMFLEET_STAGE_REPLICAS": "encode=2, prefill=3"})
    reps = parse_replicas(s.stage_replicas)
    assert reps == {"encode": 2, "prefill": 3}
    assert group_replicas(("encode",), reps) == 2
    assert group_replicas(("media-fetch", "encode"), reps) == 2  # merged stages: the largest count
    assert group_replicas(("decode",), reps) == 1
    for bad in ("encode", "encode=0", "nope=2", "encode=x"):
        with pytest.raises(UnsupportedLayout):
            parse_replicas(bad)


def test_recent_embeddings_are_bounded_in_bytes() -> None:
    import torch

    from shared.embcache.recent import RecentEmbeddings

    r = RecentEmbeddings(capacity_bytes=3 * 400)
    for i in range(4):
        r.put(f"k{i}", torch.zeros(100, dtype=torch.float32) + i)  # 400 B each
    assert r.get("k0") is None and r.bytes == 1200
    assert r.get("k1") is not None  # now most recent
    r.put("k4", torch.zeros(100))
    assert r.get("k2") is None and r.get("k1") is not None
    r.put("huge", torch.zeros(1000))  # above the capacity: not kept, nothing evicted
    assert r.get("huge") is None and r.bytes == 1200
