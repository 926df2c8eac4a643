"""Tensor transfer between processes over NIXL (UCX, DRAM): one agent and one registered,
leased pool per process. Messages carry :class:`~shared.protocol.AgentRef` /
:class:`~shared.protocol.TensorRef`; tensors never ride in messages.

Typical use::

    async with TransferAgent(f"encode-{host}-{pid}-{rand}", 256 << 20) as xa:
        ref = xa.put(embeds)                 # owner: lease a slot, publish (xa.ref(), ref)
        t = await xa.get(owner_ref, ref)     # consumer: pull into a new tensor
        await xa.release(owner_ref, [ref.lease])   # once the consumer's output is durable
"""

from shared.transfer.agent import (
    DTYPES,
    OwnerGoneError,
    PoolFullError,
    TransferAgent,
    TransferError,
)
from shared.transfer.pool import SlotAllocator

__all__ = [
    "DTYPES",
    "OwnerGoneError",
    "PoolFullError",
    "SlotAllocator",
    "TransferAgent",
    "TransferError",
]
