"""The transfer-path probe behind `mmfleet doctor`, on a CPU host: a real peer process, a NIXL
DRAM pull and a copy out of the peer's mapped pool of 1 MiB each, every byte checked (the GPU
rows are covered by tests/gpu)."""

from __future__ import annotations

import pytest

from shared.transfer.probe import format_rows, probe


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="tests/gpu probes a GPU host")
async def test_probe_moves_bytes_between_two_processes() -> None:
    rows = await probe("cpu", (1,), repeats=1)
    assert [(r.path, r.size_mib, r.ok) for r in rows] == [("staging get (NIXL DRAM)", 1, True),
                                                          ("host-shm get (mapped pool)", 1, True)]
    assert all(r.gb_s > 0 for r in rows)
    assert "staging get (NIXL DRAM)" in format_rows(rows)
