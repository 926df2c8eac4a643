"""A GPU owner's ``put`` returns before its device→pinned copy lands; a NIXL consumer must READ
the slot's staging word first and pull the bytes only once it says every chunk is there
(shared/transfer/staging.py). Run here on CPU agents over real NIXL: the test writes the word
into the owner's pool where a GPU owner's copy engine would."""

from __future__ import annotations

import asyncio
import ctypes
import os
import uuid

import msgspec
import pytest
import torch

from shared.transfer import OwnerGoneError, TransferAgent
from shared.transfer.staging import chunk_bytes_for, n_chunks, slot_bytes, wait_chunks, word_offset

N = (12 << 20) + 5  # not a multiple of 8: the word sits after padding
STAMP = 0x1234_5678


def _agent(stage: str) -> TransferAgent:
    return TransferAgent(f"{stage}-{os.getpid()}-{uuid.uuid4().hex[:8]}", 32 << 20, lease_ttl_ms=60_000)


def _set_word(addr: int, stamp: int, done: int) -> None:
    ctypes.c_int64.from_address(addr).value = stamp
    ctypes.c_int64.from_address(addr + 8).value = done


async def _staged_ref(owner: TransferAgent, data: torch.Tensor, done: int):
    """A slot laid out as a GPU owner's: data, padding, word (``done`` chunks written)."""
    slot = torch.zeros(slot_bytes(N), dtype=torch.uint8)
    slot[:N] = data
    ref = owner.put(slot)
    _set_word(ref.addr + word_offset(N), STAMP, done)
    return msgspec.structs.replace(ref, nbytes=N, shape=(N,), stamp=STAMP, chunk_bytes=chunk_bytes_for(N))


@pytest.mark.asyncio
async def test_pull_waits_for_every_chunk_then_gets_the_bytes() -> None:
    data = torch.randint(0, 256, (N,), dtype=torch.uint8)
    k = n_chunks(N, chunk_bytes_for(N))
    assert k == 4
    async with _agent("owner") as owner, _agent("consumer") as consumer:
        ref = await _staged_ref(owner, data, k - 1)
        pull = asyncio.create_task(consumer.get(owner.ref(), ref, timeout_ms=10_000))
        await asyncio.sleep(0.3)
        assert not pull.done()  # k-1 of k chunks: the consumer must not read the slot yet
        _set_word(ref.addr + word_offset(N), STAMP, k)  # the last chunk landed
        got = await asyncio.wait_for(pull, 10)
        assert torch.equal(got, data)
        assert consumer.stats()["used_bytes"] == 0  # its staging slot (data + word) went back


@pytest.mark.asyncio
async def test_a_reused_slot_or_a_copy_that_never_lands_is_owner_gone() -> None:
    data = torch.randint(0, 256, (N,), dtype=torch.uint8)
    async with _agent("owner") as owner, _agent("consumer") as consumer:
        ref = await _staged_ref(owner, data, 1)
        reused = msgspec.structs.replace(ref, stamp=STAMP + 1)  # the word names another put
        with pytest.raises(OwnerGoneError, match="holds another tensor"):
            await consumer.get(owner.ref(), reused, timeout_ms=10_000)
        with pytest.raises(OwnerGoneError, match="not done in time"):
            await consumer.get(owner.ref(), ref, timeout_ms=300)
        assert consumer.stats()["used_bytes"] == 0


def test_wait_chunks_follows_the_word() -> None:
    words = iter([(STAMP, 0), (STAMP, 1), (STAMP, 2)])
    wait_chunks(lambda: next(words), STAMP, 2, deadline=float("inf"))  # returns at the third read
    with pytest.raises(RuntimeError, match="another tensor"):
        wait_chunks(lambda: (STAMP + 1, 9), STAMP, 1, deadline=float("inf"))
    with pytest.raises(RuntimeError, match="by the deadline"):
        wait_chunks(lambda: (STAMP, 0), STAMP, 1, deadline=0.0)


def test_chunks_are_an_eighth_at_least_4_mib() -> None:
    assert chunk_bytes_for(100) == 4 << 20 and n_chunks(100, 4 << 20) == 1
    assert chunk_bytes_for(256 << 20) == 32 << 20 and n_chunks(256 << 20, 32 << 20) == 8
    assert slot_bytes(N) == word_offset(N) + 16 and word_offset(N) % 8 == 0 and word_offset(N) >= N
