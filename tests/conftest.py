"""Session fixtures: the tiny model (built once per checkout, cached under .mmfleet/), and a
real broker + redis-server on free ports for transport and fleet tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import procs

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

CACHE_DIR = procs.REPO / ".mmfleet" / "cache"


# Test files by what they cost, the longest first (prefixes; a file not named ranks last). Under
# `make test`'s two pytest-xdist workers (`--dist loadfile --no-loadscope-reorder`) each file runs
# whole on one worker (its module fixtures, a fleet, start once) and files are handed out in this
# order, so the vLLM files (minutes each) start at once, on both workers, and the many short
# files fill the end instead of one long file running alone there.
LONGEST_FIRST = ("tests/e2e/test_modes.py", "tests/engines/test_vllm_engine.py",
                 "tests/e2e/test_vllm_families_fleet.py", "tests/e2e/test_vllm_qwen2_5_vl.py", "tests/engines/",
                 "tests/chaos/", "tests/multihost/", "tests/e2e/", "tests/k8s/test_pods.py", "tests/loadtest/",
                 "tests/unit/test_decode_core",
                 "tests/transport/test_infra_stall.py")


def _rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if path.startswith(prefix)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from shared.models.qwen2_vl_tiny import ensure_tiny_qwen2_vl

    return ensure_tiny_qwen2_vl(CACHE_DIR / "models")


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def kafka_bootstrap(tmp_path_factory):
    """A broker per test module: fleets of different modules share consumer-group names, and the
    embedded broker can keep a group rebalancing for good after members of an earlier fleet died
    without leaving (seen after a SIGKILLed worker: the next fleet's prefill never got its
    partitions). A broker starts in well under a second."""
    with procs.broker(tmp_path_factory.mktemp("broker")) as bootstrap:
        yield bootstrap


@pytest.fixture(scope="session")
def redis_url(logs_dir):
    with procs.redis_server(logs_dir) as url:
        yield url
