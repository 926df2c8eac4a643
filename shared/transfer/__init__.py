"""Tensor transfer between processes over NIXL: one agent and one registered, leased pool per
process; messages carry :class:`~shared.protocol.AgentRef` / :class:`~shared.protocol.TensorRef`,
never tensors. Owner: ``ref = xa.put(t)``, publish ``(xa.ref(), ref)``; consumer:
``t = await xa.get(owner_ref, ref)``, then ``await xa.release(owner_ref, [ref.lease])`` once its
output is durable.

Design: docs/design/transfer.md.
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
