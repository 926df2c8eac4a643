"""compose/docker-compose.gpu.yml, compose/Dockerfile.gpu and compose/requirements-gpu.txt,
checked without Docker or a GPU: every engine service reserves exactly one NVIDIA GPU and is
told to compute on it (a value the real settings parser accepts), the CPU-only services get no
GPU, the image is a CUDA base installing the GPU requirements, and those requirements keep
pyproject's pins except the torch stack (a range that includes the CPU pin) and NIXL (the meta
package). Each check is shown to fire on a broken copy.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from shared import settings as settings_mod
from shared.process.device import resolve_placement

REPO = Path(__file__).resolve().parents[2]
GPU_COMPOSE = REPO / "compose" / "docker-compose.gpu.yml"
BASE_COMPOSE = REPO / "compose" / "docker-compose.yml"
GPU_DOCKERFILE = REPO / "compose" / "Dockerfile.gpu"
GPU_IGNORE = REPO / "compose" / "Dockerfile.gpu.dockerignore"
GPU_REQS = REPO / "compose" / "requirements-gpu.txt"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

ENGINE_SERVICES = {"encode", "prefill", "decode", "epd"}  # the services that run a model
RANGED = {"torch", "torchvision", "transformers", "tokenizers", "numpy"}


def check_compose(gpu: dict, base: dict) -> list[str]:
    problems = []
    services = gpu.get("services", {})
    for name in sorted(set(services) - set(base["services"])):
        problems.append(f"{name}: not a service of docker-compose.yml")
    for name in sorted(ENGINE_SERVICES):
        svc = services.get(name)
        if svc is None:
            problems.append(f"{name}: no GPU override")
            continue
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if len(devices) != 1 or devices[0].get("count") != 1 or devices[0].get("driver") != "nvidia" \
                or "gpu" not in devices[0].get("capabilities", []):
            problems.append(f"{name}: does not reserve exactly one NVIDIA GPU")
        if svc.get("build", {}).get("dockerfile") != "compose/Dockerfile.gpu":
            problems.append(f"{name}: not built from compose/Dockerfile.gpu")
        env = {**base["x-mmfleet"]["environment"], **svc.get("environment", {})}
        try:
            s = settings_mod.from_env({k: str(v) for k, v in env.items()})
            if not s.device.startswith("cuda"):
                problems.append(f"{name}: MMFLEET_DEVICE is {s.device!r}, not a GPU")
            resolve_placement("cpu", s.dtype)  # the dtype spelling (the device needs a GPU to resolve)
        except ValueError as exc:
            problems.append(f"{name}: settings: {exc}")
    for name in sorted(set(services) - ENGINE_SERVICES):
        if "deploy" in services[name]:
            problems.append(f"{name}: reserves a GPU but runs no model")
    return problems


def check_dockerfile(text: str) -> list[str]:
    problems = []
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    base = next((ln.split()[1] for ln in lines if ln.startswith("FROM ")), "")
    if not base.startswith("nvidia/cuda:"):
        problems.append(f"base image {base!r} is not a CUDA image")
    if "pip install -r requirements-gpu.txt" not in text or "COPY compose/requirements-gpu.txt" not in text:
        problems.append("does not install compose/requirements-gpu.txt")
    if "torchvision_guard" in text:
        problems.append("installs the torchvision guard (a CUDA torch has a matching torchvision)")
    if "python3.12" not in text:
        problems.append("not Python 3.12")
    users = [ln for ln in lines if ln.startswith("USER ")]
    if not users or users[-1].split()[1] in ("root", "0"):
        problems.append("does not run as a non-root user")
    return problems


def check_requirements(text: str) -> list[str]:
    problems = []
    reqs = {Requirement(ln).name: Requirement(ln) for ln in text.splitlines() if ln.strip() and not ln.startswith("#")}
    for dep in map(Requirement, PYPROJECT["project"]["dependencies"]):
        if dep.name == "nixl-cu12":
            continue
        cpu_pin = next(iter(dep.specifier)).version
        got = reqs.get(dep.name)
        if got is None:
            problems.append(f"{dep.name} missing")
        elif dep.name in RANGED:
            if not got.specifier.contains(cpu_pin):
                problems.append(f"{dep.name}: range {got.specifier} excludes the CPU pin {cpu_pin}")
        elif str(got.specifier) != str(dep.specifier):
            problems.append(f"{dep.name}: {got.specifier} differs from pyproject's {dep.specifier}")
    if str(reqs.get("nixl", Requirement("nixl")).specifier) != "==1.5.1":
        problems.append("nixl meta package is not pinned ==1.5.1")
    if "nixl-cu12" in reqs:
        problems.append("nixl-cu12 pinned: breaks a CUDA-13 host")
    return problems


@pytest.fixture(scope="module")
def files() -> tuple[dict, dict]:
    return yaml.safe_load(GPU_COMPOSE.read_text()), yaml.safe_load(BASE_COMPOSE.read_text())


def test_gpu_variant_passes_every_check(files) -> None:
    gpu, base = files
    assert check_compose(gpu, base) == []
    assert check_dockerfile(GPU_DOCKERFILE.read_text()) == []
    assert check_requirements(GPU_REQS.read_text()) == []
    assert "!compose/requirements-gpu.txt" in GPU_IGNORE.read_text().splitlines()


def test_python_312_is_allowed() -> None:
    spec = PYPROJECT["project"]["requires-python"]
    from packaging.specifiers import SpecifierSet

    assert all(v in SpecifierSet(spec) for v in ("3.11", "3.12")), spec


def _set(path: str, value):
    def mutate(doc: dict) -> None:
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[p]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return mutate


@pytest.mark.parametrize("mutate, expected", [
    (_set("services.prefill.deploy", None), "prefill: does not reserve exactly one"),
    (_set("services.decode.deploy", {"resources": {"reservations": {"devices": [
        {"driver": "nvidia", "count": 2, "capabilities": ["gpu"]}]}}}), "decode: does not reserve exactly one"),
    (_set("services.encode.environment", {"MMFLEET_DEVICE": "cpu"}), "not a GPU"),
    (_set("services.encode.environment", {"MMFLEET_DEVICE": "cuda", "MMFLEET_DTYPE": "fp8"}), "settings"),
    (_set("services.epd", None), "epd: no GPU override"),
    (_set("services.gateway", {"deploy": {}}), "gateway: reserves a GPU"),
])
def test_each_compose_check_fires(files, mutate, expected) -> None:
    gpu, base = copy.deepcopy(files[0]), files[1]
    mutate(gpu)
    assert any(expected in p for p in check_compose(gpu, base)), check_compose(gpu, base)


@pytest.mark.parametrize("old, new, expected", [
    ("FROM nvidia/cuda:", "FROM python:3.12-slim #", "not a CUDA image"),
    ("pip install -r requirements-gpu.txt", "pip install torch", "requirements-gpu"),
    ("USER mmfleet", "USER root", "non-root"),
])
def test_each_dockerfile_check_fires(old, new, expected) -> None:
    text = GPU_DOCKERFILE.read_text()
    assert old in text
    assert any(expected in p for p in check_dockerfile(text.replace(old, new, 1)))


@pytest.mark.parametrize("old, new, expected", [
    ("torch>=2.11,<2.14", "torch>=2.14", "excludes the CPU pin"),
    ("redis==8.1.0", "redis==8.0.0", "differs from pyproject"),
    ("nixl==1.5.1", "nixl-cu12==1.5.1", "nixl"),
    ("tqdm==4.70.1\n", "", "tqdm missing"),
])
def test_each_requirements_check_fires(old, new, expected) -> None:
    text = GPU_REQS.read_text()
    assert old in text
    assert any(expected in p for p in check_requirements(text.replace(old, new, 1)))
