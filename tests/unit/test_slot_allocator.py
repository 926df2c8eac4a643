"""SlotAllocator: first-fit placement, alignment, coalescing, errors, random invariants."""

from __future__ import annotations

import random

import pytest

from shared.transfer.pool import SlotAllocator


def check_invariants(a: SlotAllocator) -> None:
    blocks = sorted(
        [(o, s, "used") for o, s in a.allocated_blocks()] + [(o, s, "free") for o, s in a.free_blocks()]
    )
    # Used and free blocks tile [0, capacity) exactly: no overlap, no gap.
    pos = 0
    for off, size, _ in blocks:
        assert off == pos, f"gap/overlap at {pos}: {blocks}"
        assert size > 0
        pos += size
    assert pos == a.capacity_bytes
    assert a.used_bytes + a.free_bytes == a.capacity_bytes
    assert a.used_bytes == sum(s for _, s in a.allocated_blocks())
    # Free list is fully coalesced: no two free blocks touch.
    free = a.free_blocks()
    for (o1, s1), (o2, _) in zip(free, free[1:]):
        assert o1 + s1 < o2
    for off, _ in a.allocated_blocks():
        assert off % a.align_bytes == 0


def test_alloc_aligned_first_fit() -> None:
    a = SlotAllocator(1024, align_bytes=64)
    assert a.alloc(1) == 0
    assert a.alloc(64) == 64
    assert a.alloc(65) == 128  # rounds to 128
    assert a.used_bytes == 256
    assert a.alloc(0) == 256  # zero bytes still gets a unique aligned slot
    assert a.used_bytes == 320
    check_invariants(a)


def test_full_and_none() -> None:
    a = SlotAllocator(256, align_bytes=64)
    offs = [a.alloc(64) for _ in range(4)]
    assert offs == [0, 64, 128, 192]
    assert a.alloc(1) is None
    assert a.free_bytes == 0 and a.largest_free == 0
    a.free(64)
    assert a.alloc(64) == 64


def test_coalesce_both_sides() -> None:
    a = SlotAllocator(512, align_bytes=64)
    o = [a.alloc(64) for _ in range(8)]
    for i in (1, 3):
        a.free(o[i])
    assert a.free_blocks() == [(64, 64), (192, 64)]
    a.free(o[2])  # merges prev and next into one block
    assert a.free_blocks() == [(64, 192)]
    a.free(o[0])  # merges with next
    assert a.free_blocks() == [(0, 256)]
    a.free(o[7])
    a.free(o[5])
    a.free(o[6])
    a.free(o[4])
    assert a.free_blocks() == [(0, 512)]
    check_invariants(a)


def test_fragmentation_first_fit() -> None:
    a = SlotAllocator(640, align_bytes=64)
    o = [a.alloc(64) for _ in range(10)]
    for i in range(0, 10, 2):
        a.free(o[i])
    assert a.free_bytes == 320
    assert a.largest_free == 64
    assert a.alloc(128) is None  # enough bytes in total, but fragmented
    assert a.alloc(10) == 0  # first fit takes the lowest hole
    check_invariants(a)


def test_double_free_and_unknown() -> None:
    a = SlotAllocator(256)
    off = a.alloc(10)
    a.free(off)
    with pytest.raises(KeyError):
        a.free(off)
    with pytest.raises(KeyError):
        a.free(12345)
    with pytest.raises(ValueError):
        a.alloc(-1)
    with pytest.raises(ValueError):
        SlotAllocator(0)
    with pytest.raises(ValueError):
        SlotAllocator(128, align_bytes=48)


def test_unaligned_capacity_tail() -> None:
    a = SlotAllocator(100, align_bytes=64)
    assert a.alloc(64) == 0
    assert a.alloc(1) is None  # 36 B tail cannot hold an aligned 64 B unit
    assert a.free_bytes == 36
    check_invariants(a)


@pytest.mark.parametrize("seed", range(5))
def test_random_alloc_free_invariants(seed: int) -> None:
    rng = random.Random(seed)
    a = SlotAllocator(64 * 1024, align_bytes=64)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and (rng.random() < 0.45 or a.free_bytes < 1024):
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            n = rng.choice([0, 1, 63, 64, 65, 500, 4096, rng.randrange(1, 9000)])
            off = a.alloc(n)
            if off is None:
                assert a.largest_free < a.reserved_size(n)
                continue
            # The new slot overlaps no live slot.
            size = a.reserved_size(n)
            for o, s in live.items():
                assert off + size <= o or o + s <= off
            live[off] = size
        check_invariants(a)
    for off in list(live):
        a.free(off)
    assert a.free_blocks() == [(0, 64 * 1024)]
    assert a.used_bytes == 0
