"""Block hashes and the prefix KV cache (shared.kv), without a fleet."""

from __future__ import annotations

import torch

from shared import protocol
from shared.kv.blocks import block_hashes, expand
from shared.kv.prefix_cache import PrefixCache

PH = 99  # placeholder token id


def item(index: int, mm_hash: str, n_tokens: int) -> protocol.EmbeddingItem:
    ref = protocol.TensorRef(agent="a", addr=0, nbytes=0, device_id=0, lease=0, dtype="float32", shape=())
    return protocol.EmbeddingItem(index=index, mm_hash=mm_hash, grid_thw=(1, 2, 2), n_tokens=n_tokens, embeds=ref)


def test_expand_places_each_item_at_its_placeholder_in_index_order():
    tokens, spans = expand([1, PH, 2, PH], [item(1, "b", 2), item(0, "a", 3)], PH)
    assert tokens == [1, PH, PH, PH, 2, PH, PH]
    assert spans == [(1, 4, "a"), (5, 7, "b")]


def test_prompts_differing_only_in_the_image_never_share_a_block():
    prompt = [1, 2, PH, 3, 4, 5, 6, 7]
    a = block_hashes(prompt, [item(0, "img-a", 12)], placeholder_id=PH, block_size=4)
    b = block_hashes(prompt, [item(0, "img-b", 12)], placeholder_id=PH, block_size=4)
    assert len(a) == len(b) == 4  # 19 positions: 4 whole blocks
    assert not set(a) & set(b)
    # every block after the image differs too (the parent chain carries it)
    assert a == block_hashes(prompt, [item(0, "img-a", 12)], placeholder_id=PH, block_size=4)


def test_hashes_are_a_prefix_chain():
    base = list(range(10, 42))
    longer = base + [7, 8, 9, 10, 11, 12, 13, 14]
    short = block_hashes(base, [], placeholder_id=PH, block_size=8)
    long = block_hashes(longer, [], placeholder_id=PH, block_size=8)
    assert long[: len(short)] == short and len(long) == 5
    changed = block_hashes([0] + base[1:], [], placeholder_id=PH, block_size=8)
    assert not set(changed) & set(short), "a change in block 0 changes every later block"
    assert len(block_hashes(base[:7], [], placeholder_id=PH, block_size=8)) == 0


def kv_of(n: int, fill: float = 0.0) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32).view(1, 1, 1, n, 1).expand(2, 2, 2, n, 4).contiguous() + fill


def test_cache_matches_longest_prefix_and_reports_changes():
    cache = PrefixCache(capacity_bytes=1 << 20, block_size=4)
    kv = kv_of(12)
    changes = cache.store([1, 2, 3], kv)
    assert changes.stored == [1, 2, 3] and changes.removed == []
    assert cache.store([1, 2, 3], kv).stored == []  # nothing new
    hit = cache.match([1, 2, 9, 3])
    assert len(hit) == 2
    assert torch.equal(torch.cat(hit, dim=3), kv[:, :, :, :8])
    assert cache.match([5, 1]) == []


def test_cache_is_bounded_in_bytes_and_evicts_leaves_before_roots():
    block_bytes = 2 * 2 * 2 * 4 * 4 * 4
    cache = PrefixCache(capacity_bytes=4 * block_bytes, block_size=4)
    cache.store([1, 2, 3], kv_of(12))
    changes = cache.store([7, 8], kv_of(8, 100.0))
    assert cache.bytes == 4 * block_bytes
    assert changes.removed == [3], "the old chain's leaf goes first"
    assert len(cache.match([1, 2, 3])) == 2
    assert changes.stored == [7, 8]


def test_zero_capacity_is_off():
    cache = PrefixCache(capacity_bytes=0, block_size=4)
    assert cache.store([1], kv_of(4)).stored == [] and len(cache) == 0
