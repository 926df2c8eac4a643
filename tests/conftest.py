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


# files whose tests start vLLM engines (GiBs each): one pytest-xdist worker runs them all, one
# after another, so two never run at once (`make test` runs two workers)
VLLM_FILES = ("tests/engines/", "tests/e2e/test_modes.py")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup``: a test file runs whole on one worker (its
    module fixtures, a fleet, start once), the vLLM files together on one."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = "vllm" if path.startswith(VLLM_FILES) else path
        item.add_marker(pytest.mark.xdist_group(group))


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
