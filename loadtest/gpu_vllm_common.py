"""What the vLLM GPU check's phases share (:mod:`loadtest.gpu_vllm_check` runs them): the phases'
budgets, the fleet's and ``vllm serve``'s engine choices, and the docs-format record writer.
Docs: docs/deploy/gpus.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest import procs


@dataclass(frozen=True)
class Phase:
    expected_s: int  # on one H200 with the model's files in the page cache
    timeout_s: int
    needs_gpu: bool
    what: str


PHASES: dict[str, Phase] = {
    "build": Phase(45, 300, True, "Qwen2-VL-2B-shaped model, random bf16 weights drawn on the GPU (cached)"),
    "preflight": Phase(25, 180, False, "imports, `vllm serve` / `vllm bench serve` parsers, the fleet's engine "
                                       "arguments as vLLM's"),
    "ref": Phase(60, 300, True, "vLLM's offline LLM.generate: text, one and two images (the fleet encoder's "
                                "embeddings, and vLLM's own encoder)"),
    "pd": Phase(90, 360, True, "P->D hand-off = LLM.generate, KV buffer on the GPU, then on the host"),
    "fleets": Phase(270, 570, True, "epd and e-p-d answers = LLM.generate; e-p-d and vllm serve under vllm bench "
                                    "serve (c=1, 16) and the sliding-window workload (c=1, 8)"),
}
ORDER = tuple(PHASES)
RESULTS = procs.REPO / "loadtest" / "results"


def engine_settings(args: argparse.Namespace) -> dict[str, str]:
    """The fleet's settings (as ``fleet:<mode>,name=value`` takes them) every vLLM fleet runs with."""
    out = {"engine": "vllm", "device": args.device, "vllm_enforce_eager": "false" if args.cuda_graphs else "true",
           "vllm_max_model_len_tokens": str(args.max_model_len)}
    if args.device == "cuda":
        out["vllm_gpu_memory_utilization"] = str(args.gpu_memory_utilization)
        # the KV hand-off through host memory: where UCX has no GPU transport (the H100 and H200
        # hosts measured, docs/benchmarks/gpu.md) NIXL on VRAM runs over TCP loopback; phase pd
        # checks both buffers
        out["vllm_kv_buffer_device"] = "cpu"
    return out


def serve_args(args: argparse.Namespace) -> list[str] | None:
    """``vllm serve``'s engine flags, the same choices as the fleet's engines (None on CPU: the
    harness's CPU flags)."""
    if args.device == "cpu":
        return None
    return ["--dtype", "bfloat16", "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--max-model-len", str(args.max_model_len), *([] if args.cuda_graphs else ["--enforce-eager"])]


# ---------------------------------------------------------------- records (docs/benchmarks/README.md)
def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=procs.REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def machine() -> dict:
    """The record's machine: cores, CPU model, and the GPU with the software that ran on it."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), "") or f"{platform.machine()} (model not recorded)"
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = (f"{props.name} ({props.total_memory / 2**30:.0f} GiB); Python {platform.python_version()}, "
               f"torch {torch.__version__}, CUDA {torch.version.cuda}, " + ", ".join(
                   f"{d} {_version(d)}" for d in ("vllm", "nixl-cu13", "transformers")))
    # memory_gib: a microVM's MemTotal starts small and grows with use, so it is not recorded
    return {"cores": os.cpu_count(), "cpu": cpu, "memory_gib": None, "gpu": gpu}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def gpu_slug() -> str:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return name.lower().replace("nvidia", "").strip().split()[0].replace("_", "-") or "gpu"


def write_record(out: Path, rid: str, *, title: str, command: str, conditions: str, commit_hash: str,
                 tables: list[dict], plots: list[dict] | None = None) -> Path:
    """One record in the docs format, checked by :func:`loadtest.publish.validate` before it is written."""
    from loadtest.publish import validate

    rec = {"id": rid, "title": title, "date": time.strftime("%Y-%m-%d"), "commit": commit_hash,
           "machine": machine(), "command": command, "conditions": conditions, "tables": tables,
           **({"plots": plots} if plots else {})}
    errors = validate(rec, rid)
    if errors:
        raise ValueError(f"record {rid}: " + "; ".join(errors))
    path = out / "records" / f"{rid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
    return path
