"""Child process for the NIXL transport tests: owns tensors, answers stats over stdio.

Run as ``python -m tests.transport.owner_proc NAME POOL_BYTES TTL_MS SIZE[,SIZE...] [WAKE_MS]``
from the repository root. With ``WAKE_MS`` (NIXL's progress thread; 0: none) the owner's
Python never polls after its puts (no fast window, a 10-minute idle poll): only the
thread can serve a READ. Puts one float32 tensor per size (``expected_tensor(nbytes, i)``),
then prints one line ``@@<json Hello>`` and serves line commands on stdin:
``stats`` -> ``@@<json dict>``; ``quit`` or EOF -> exit. Only lines starting with ``@@``
are protocol (nixl or UCX may print other lines).
"""

from __future__ import annotations

import asyncio
import sys

import msgspec
import torch

from shared.protocol import AgentRef, TensorRef

MARK = "@@"


class Hello(msgspec.Struct):
    agent: AgentRef
    refs: list[TensorRef]


def expected_tensor(nbytes: int, index: int) -> torch.Tensor:
    """Deterministic float32 content (exact in float32 up to 4 MiB)."""
    return torch.arange(nbytes // 4, dtype=torch.float32).mul_(0.5).add_(index + 1)


def emit(obj: object) -> None:
    sys.stdout.write(MARK + msgspec.json.encode(obj).decode() + "\n")
    sys.stdout.flush()


async def main(name: str, pool_bytes: int, ttl_ms: int, sizes: list[int], wake_ms: int | None) -> None:
    from shared.transfer import TransferAgent

    quiet = {} if wake_ms is None else {"progress_wake_ms": wake_ms, "fast_window_ms": 0, "idle_poll_ms": 600_000}
    async with TransferAgent(name, pool_bytes, lease_ttl_ms=ttl_ms, **quiet) as xa:
        refs = [xa.put(expected_tensor(n, i)) for i, n in enumerate(sizes)]
        emit(Hello(xa.ref(), refs))
        while True:
            line = (await asyncio.to_thread(sys.stdin.readline)).strip()
            if line == "stats":
                emit(xa.stats())
            elif line in ("quit", ""):
                return


if __name__ == "__main__":
    _name, _pool, _ttl, _sizes = sys.argv[1:5]
    _wake = int(sys.argv[5]) if len(sys.argv) > 5 else None
    asyncio.run(main(_name, int(_pool), int(_ttl), [int(s) for s in _sizes.split(",")], _wake))
