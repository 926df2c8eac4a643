"""The agent's side of talking to peers over NIXL (:class:`Peers`): their metadata, and one
polled READ. ``ensure`` loads a peer's metadata once (NIXL connects eagerly, ~10 ms) and checks
it names that peer; ``forget`` drops it so a later pull reconnects. ``await_staged`` READs a GPU
owner's staging word until the slot's bytes are there. ``read`` is one one-sided READ polled from
the event loop; any failure raises :class:`OwnerGoneError`, and a READ NIXL cannot cancel calls
``on_stuck``: the local bytes may still be written and must never be reused.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from shared.protocol import AgentRef, TensorRef
from shared.transfer.staging import WORD_BYTES, chunks_done, n_chunks, word_offset
from shared.transfer.tensors import OwnerGoneError

log = logging.getLogger(__name__)

_SPIN_S = 0.0002  # yield-only polling window of a pull before timed sleeps


class Peers:
    def __init__(self, nixl, name: str) -> None:
        self._nixl = nixl
        self._name = name
        self._remotes: dict[str, bytes] = {}  # peer name -> metadata loaded into NIXL

    def __len__(self) -> int:
        return len(self._remotes)

    def __contains__(self, name: str) -> bool:
        return name in self._remotes

    def ensure(self, owner: AgentRef) -> None:
        if self._remotes.get(owner.name) == owner.metadata:
            return
        loaded = self._nixl.add_remote_agent(owner.metadata)
        # 1.5.1 returns the name as bytes; a mismatch means the ref lies about its owner.
        loaded_s = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_s != owner.name:
            raise ValueError(f"metadata is for agent {loaded_s!r}, not {owner.name!r}")
        self._remotes[owner.name] = owner.metadata

    def forget(self, name: str) -> None:
        if self._remotes.pop(name, None) is not None:
            try:
                self._nixl.remove_remote_agent(name)
            except Exception as e:
                log.debug("remove_remote_agent(%s): %s", name, e)

    async def read(self, owner: AgentRef, ref: TensorRef, local_addr: int, deadline: float, poll_s: float,
                   on_stuck: Callable[[], None]) -> None:
        """One NIXL READ of ``ref`` into ``local_addr``; OwnerGoneError on failure."""
        nx = self._nixl
        handle = None
        try:
            self.ensure(owner)
            local = nx.get_xfer_descs([(local_addr, ref.nbytes, 0)], "DRAM")
            remote = nx.get_xfer_descs([(ref.addr, ref.nbytes, ref.device_id)], "DRAM")
            handle = nx.initialize_xfer("READ", local, remote, owner.name, b"")
            state = nx.transfer(handle)
            spin_until = time.monotonic() + _SPIN_S
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError("transfer timed out")
                await asyncio.sleep(0 if now < spin_until else poll_s)
                state = nx.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
        except asyncio.CancelledError:
            self._release(handle, on_stuck)
            raise
        except Exception as e:
            self._release(handle, on_stuck)
            raise OwnerGoneError(
                f"{self._name}: cannot pull lease {ref.lease} ({ref.nbytes} B) from "
                f"{owner.name}: {type(e).__name__}: {e}"
            ) from e
        self._release(handle, on_stuck)

    async def await_staged(self, owner: AgentRef, ref: TensorRef, local_addr: int,
                           read_local: Callable[[], tuple[int, int]],
                           deadline: float, poll_s: float, on_stuck: Callable[[], None]) -> None:
        """READ the owner's staging word of ``ref`` into ``local_addr`` until it says every chunk
        is in the owner's pool (:mod:`shared.transfer.staging`); OwnerGoneError if the slot
        holds another tensor or the deadline passes."""
        word_ref = msgspec.structs.replace(ref, addr=ref.addr + word_offset(ref.nbytes), nbytes=WORD_BYTES)
        need = n_chunks(ref.nbytes, ref.chunk_bytes)
        while True:
            await self.read(owner, word_ref, local_addr, deadline, poll_s, on_stuck)
            done = chunks_done(read_local(), ref.stamp)
            if done >= need:
                return
            if done < 0:
                raise OwnerGoneError(f"{self._name}: lease {ref.lease} of {owner.name}: the slot holds another tensor")
            if time.monotonic() > deadline:
                raise OwnerGoneError(f"{self._name}: lease {ref.lease} of {owner.name}: staging not done in time")
            await asyncio.sleep(poll_s)

    def _release(self, handle: object, on_stuck: Callable[[], None]) -> None:
        if handle is None:
            return
        try:
            handle.release()  # type: ignore[attr-defined]
        except Exception as e:
            log.error("%s: xfer handle release failed, quarantining slot: %s", self._name, e)
            on_stuck()
