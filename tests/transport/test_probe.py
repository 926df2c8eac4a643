"""The transfer-path probe behind `mmfleet doctor`, on a CPU host: a real peer process, one
NIXL DRAM pull of 1 MiB, every byte checked (the GPU rows are covered by tests/gpu)."""

from __future__ import annotations

import pytest

from shared.transfer.probe import format_rows, probe


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="tests/gpu probes a GPU host")
async def test_probe_moves_bytes_between_two_processes() -> None:
    rows = await probe("cpu", (1,), repeats=1)
    assert [(r.path, r.size_mib, r.ok) for r in rows] == [("staging get (NIXL DRAM)", 1, True)]
    assert rows[0].gb_s > 0
    assert "staging get (NIXL DRAM)" in format_rows(rows)
