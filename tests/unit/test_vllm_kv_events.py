"""vLLM KV cache events → the fleet's block keys (shared.engines.vllm_kv_events.BlockTranslator),
with vLLM's own event structs, as its zmq publisher encodes them. The engine-level test (a real
vLLM producer's events landing in the routing table) is in tests/engines/test_vllm_pd.py."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from shared.engines.vllm_kv_events import BlockTranslator, vllm_block_size  # noqa: E402

OURS = [1000 + i for i in range(9)]  # a prompt of 9 of our blocks: 4 whole vLLM blocks at ratio 2


def stored(hashes, parent, session, block_size=32):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[7] * block_size * len(hashes),
                       block_size=block_size, lora_id=None, medium="GPU", lora_name=None, session_id=session)


def wire(*events):
    """Through vLLM's own encoding (as its publisher sends it) and back."""
    batch = KVEventBatch(ts=0.0, events=list(events))
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(msgspec.msgpack.Encoder().encode(batch)).events


def test_vllm_block_size_is_a_multiple_of_32_and_ours():
    assert [vllm_block_size(b) for b in (16, 32, 48, 64, 128)] == [32, 32, 96, 64, 128]
    with pytest.raises(ValueError):
        vllm_block_size(0)


def test_blocks_map_to_our_keys_by_session_and_chain_position():
    t = BlockTranslator(2)
    t.register("r1", OURS)
    t.apply(wire(stored([11, 12], None, "r1"), stored([13], 12, "r1")))
    assert t.held_blocks("r1") == 3
    ch = t.take()
    assert ch.stored == OURS[:6] and ch.removed == [] and not ch.cleared
    assert not t.take()  # nothing new
    # a block past the registered prompt (decode tokens) maps to no key; its removal neither
    t.apply(wire(stored([14, 15], 13, "r1")))
    ch = t.take()
    assert ch.stored == OURS[6:8] and t.held_blocks("r1") == 4
    t.apply(wire(BlockRemoved(block_hashes=[15, 13], medium="GPU")))
    assert t.take().removed == OURS[4:6]


def test_reused_blocks_are_not_stored_twice_and_shared_keys_are_counted():
    t = BlockTranslator(2)
    t.register("a", OURS)
    t.register("b", OURS[:2] + [2000, 2001])
    t.apply(wire(stored([11, 12], None, "a")))
    # b reuses block 11 (announced by a) and computes its own second block
    assert t.held_blocks("b") == 1
    t.apply(wire(stored([22], 11, "b")))
    ch = t.take()
    assert ch.stored == [*OURS[:4], 2000, 2001]
    assert t.held_blocks("b") == 2
    t.apply(wire(BlockRemoved(block_hashes=[12], medium="GPU")))
    assert t.take().removed == OURS[2:4]
    # one key behind two vLLM blocks (vLLM keyed on something ours does not): gone with the last
    t.register("c", OURS[:2])
    t.apply(wire(stored([31], None, "c")))
    assert t.take().stored == []
    t.apply(wire(BlockRemoved(block_hashes=[11], medium="GPU")))
    assert t.take().removed == []
    t.apply(wire(BlockRemoved(block_hashes=[31], medium="GPU")))
    assert t.take().removed == OURS[:2]


def test_net_changes_cleared_and_unplaceable_blocks():
    t = BlockTranslator(2)
    t.register("r", OURS)
    t.apply(wire(stored([11], None, "r"), BlockRemoved(block_hashes=[11], medium="GPU")))
    ch = t.take()
    assert ch.stored == [] and ch.removed == OURS[:2]  # stored then evicted: removed (harmless)
    t.apply(wire(stored([11], None, "r")))
    t.apply(wire(AllBlocksCleared()))
    t.apply(wire(stored([11], None, "r")))
    ch = t.take()
    assert ch.cleared and ch.stored == OURS[:2]
    before = t.unmatched
    t.apply(wire(stored([41], None, "nobody"), stored([42], 999, "r")))  # unknown session, unknown parent
    assert t.unmatched == before + 2 and not t.take()


def test_pending_changes_are_bounded_by_a_resync():
    t = BlockTranslator(1, max_pending=4)
    t.register("r", list(range(10)))
    t.apply(wire(stored([1, 2, 3], None, "r")))
    t.apply(wire(stored([4, 5], 3, "r")))  # 5 pending keys > 4: one resync event instead
    ch = t.take()
    assert ch.cleared and sorted(ch.stored) == [0, 1, 2, 3, 4] and ch.removed == []


async def test_wait_stored_wakes_when_the_blocks_arrive_and_times_out_otherwise():
    t = BlockTranslator(2)
    t.register("r", OURS)
    waiter = asyncio.ensure_future(t.wait_stored("r", 2, 5.0))
    await asyncio.sleep(0)
    t.apply(wire(stored([11], None, "r")))
    await asyncio.sleep(0)
    assert not waiter.done()
    t.apply(wire(stored([12], 11, "r")))
    assert await waiter is True
    assert await t.wait_stored("r", 3, 0.05) is False
    assert await t.wait_stored("r", 0, 0.05) is True
    assert t.held_blocks("nobody") == 0
