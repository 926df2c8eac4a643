"""CPU tensors between processes of one host: the consumer maps the owner's memfd pool and
copies the slot (shared/transfer/host_shm.py) instead of a NIXL READ; anything it cannot map
(another host, an owner that exited, sharing off) goes over NIXL as before.

Owners run as ``tests.transport.owner_proc`` children, always killed and reaped."""

from __future__ import annotations

import os
import signal

import msgspec
import pytest
import torch

from shared.protocol import HostShm
from shared.transfer import OwnerGoneError, TransferAgent
from tests.transport.owner_proc import expected_tensor
from tests.transport.test_nixl_transfer import KIB4, MIB4, owner_process, uniq


@pytest.mark.asyncio
async def test_a_cpu_pull_on_one_host_copies_from_the_owners_mapped_pool() -> None:
    async with owner_process([KIB4, MIB4, KIB4]) as (owner, hello):
        assert all(r.host_shm is not None and r.host_shm.path.startswith("/proc/") for r in hello.refs)
        async with TransferAgent(uniq("consumer"), 8 << 20) as xa:
            for _ in range(3):
                for i, n in enumerate((KIB4, MIB4, KIB4)):
                    got = await xa.get(hello.agent, hello.refs[i])
                    assert torch.equal(got, expected_tensor(n, i))
            many = await xa.get_many([(hello.agent, r) for r in hello.refs])
            many[1].zero_()  # the caller owns its copy: the owner's slot is untouched
            assert torch.equal(await xa.get(hello.agent, hello.refs[1]), expected_tensor(MIB4, 1))
            st = xa.stats()
            assert st["shm_gets"] == 9 + 3 + 1 and st["transfers"] == 0 and st["used_bytes"] == 0
            # release still reaches the owner (a NIXL notification): its slots go back
            await xa.release(hello.agent, [hello.refs[0].lease, hello.refs[1].lease])
            after = await owner.wait_stats(lambda s: s["leases_outstanding"] == 1, timeout=10.0)
            assert after["released_leases"] == 2


@pytest.mark.asyncio
async def test_another_hosts_ref_or_sharing_off_goes_over_nixl() -> None:
    async with owner_process([KIB4]) as (_owner, hello):
        ref = hello.refs[0]
        elsewhere = msgspec.structs.replace(ref, host_shm=HostShm("other-host/boot", ref.host_shm.path,
                                                                  ref.host_shm.pool_bytes, ref.host_shm.offset))
        async with TransferAgent(uniq("consumer"), 1 << 20) as xa:
            assert torch.equal(await xa.get(hello.agent, elsewhere), expected_tensor(KIB4, 0))
            assert xa.stats()["transfers"] == 1 and xa.stats()["shm_gets"] == 0
        async with TransferAgent(uniq("nixl-only"), 1 << 20, shared_pool=False) as xa:
            assert torch.equal(await xa.get(hello.agent, ref), expected_tensor(KIB4, 0))
            assert xa.stats()["transfers"] == 1 and xa.stats()["shm_gets"] == 0
            plain = xa.put(torch.ones(4))
            assert plain.host_shm is None  # its own pool is not shared either


@pytest.mark.asyncio
async def test_an_owner_that_exited_is_owner_gone_even_with_its_pool_mapped() -> None:
    """The consumer's mapping would outlive the owner (and its memory with it): a pull checks
    the owner still holds the file, drops the mapping, and the NIXL path reports it gone."""
    async with owner_process([KIB4, KIB4]) as (owner, hello):
        async with TransferAgent(uniq("consumer"), 1 << 20) as xa:
            assert torch.equal(await xa.get(hello.agent, hello.refs[0]), expected_tensor(KIB4, 0))
            assert xa.stats()["shm_gets"] == 1
            owner.proc.send_signal(signal.SIGKILL)
            await owner.proc.wait()
            with pytest.raises(OwnerGoneError):
                await xa.get(hello.agent, hello.refs[1], timeout_ms=3000)
            st = xa.stats()
            assert st["shm_gets"] == 1 and st["shm_failures"] == 1 and st["transfer_errors"] == 1


@pytest.mark.asyncio
async def test_a_pool_closed_in_process_is_not_read_through_a_reused_fd() -> None:
    """Two agents of one process: the pull maps the other's pool through /proc/<pid>/fd. Once
    the owner stops, its fd number may name another file: the inode check refuses it."""
    a, b = TransferAgent(uniq("a"), 1 << 20), TransferAgent(uniq("b"), 1 << 20)
    await a.start()
    await b.start()
    try:
        src = torch.randn(64, 3)
        ref = a.put(src)
        assert torch.equal(await b.get(a.ref(), ref), src)
        assert b.stats()["shm_gets"] == 1
        await a.stop()
        fd = int(ref.host_shm.path.rsplit("/", 1)[1])
        reuse = os.memfd_create("not-the-pool")  # lowest free number: likely the pool's old fd
        try:
            os.ftruncate(reuse, ref.host_shm.pool_bytes)
            assert reuse == fd or not os.path.exists(ref.host_shm.path)
            with pytest.raises(OwnerGoneError):
                await b.get(a.ref(), ref, timeout_ms=500)
            assert b.stats()["shm_failures"] == 1 and b.stats()["shm_gets"] == 1
        finally:
            os.close(reuse)
    finally:
        await a.stop()
        await b.stop()


@pytest.mark.asyncio
async def test_a_path_naming_another_file_is_not_mapped() -> None:
    """The owner's /proc path opened where another process sits behind that pid (another pid
    namespace, same host name): the file's inode is not the pool's, so NIXL carries the pull."""
    async with owner_process([KIB4]) as (_owner, hello):
        ref = hello.refs[0]
        other = os.memfd_create("someone-else")
        try:
            os.ftruncate(other, ref.host_shm.pool_bytes)
            elsewhere = msgspec.structs.replace(ref, host_shm=msgspec.structs.replace(
                ref.host_shm, path=f"/proc/{os.getpid()}/fd/{other}"))
            async with TransferAgent(uniq("consumer"), 1 << 20) as xa:
                assert torch.equal(await xa.get(hello.agent, elsewhere), expected_tensor(KIB4, 0))
                st = xa.stats()
                assert st["shm_failures"] == 1 and st["shm_gets"] == 0 and st["transfers"] == 1
        finally:
            os.close(other)
