"""The vLLM GPU check and the wheel carrying, on CPU: the check's parser, its device plan and its
refusal without a GPU (nothing started, vLLM never imported); splitting, receiving, verifying and
installing wheels into a fresh --target; the records it writes; the 2B model's shapes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from loadtest import gpu_vllm_check as check
from loadtest import gpu_vllm_common as common
from loadtest import gpu_vllm_plan, gpu_wheels
from tests import procs


def test_the_parser_orders_the_phases_and_refuses_unknown_ones(tmp_path):
    args = check.parse(["--phases", "pd,build", "--out", str(tmp_path)])
    assert args.phases == ["build", "pd"] and args.out == tmp_path
    assert check.parse([]).phases == list(check.ORDER)
    assert check.parse([]).out.parent == check.RESULTS
    with pytest.raises(SystemExit):
        check.parse(["--phases", "build,warp"])


def test_without_a_gpu_it_refuses_before_anything_starts(tmp_path):
    out = tmp_path / "never"
    r = subprocess.run([sys.executable, "-m", "loadtest.gpu_vllm_check", "--out", str(out)], cwd=procs.REPO,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "REFUSED: no GPU" in r.stdout and "CUDA_VISIBLE_DEVICES=''" in r.stdout
    assert "build" in r.stdout and "fleets" in r.stdout  # it says what it would have run
    assert not out.exists()


def test_the_refusal_imports_neither_vllm_nor_torch_when_the_env_hides_the_gpus(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    before = set(sys.modules)
    assert check.main(["--dry-run"]) == 2
    assert "REFUSED" in capsys.readouterr().out
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("vllm", "torch")}
    assert check.no_gpu_reason({"CUDA_VISIBLE_DEVICES": "-1"}).startswith("CUDA_VISIBLE_DEVICES='-1'")


def test_torch_without_a_gpu_is_a_reason_too():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert "sees no CUDA GPU" in check.no_gpu_reason({})


def test_the_preflight_alone_is_not_refused_without_a_gpu(monkeypatch, capsys):
    """Imports and parsers only: the CPU rehearsal runs it (docs/deploy/gpus.md); every other phase needs one."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert check.main(["--phases", "preflight", "--dry-run"]) == 0
    assert "REFUSED" not in capsys.readouterr().out
    assert all(check.PHASES[p].needs_gpu for p in check.ORDER if p != "preflight")


def test_the_device_plan_fits_the_lease_and_the_tool(tmp_path):
    manifest = {"calls": 7, "piece_bytes": 60 << 20, "files": []}
    args = check.parse(["--commit", "abc1234"])
    steps = gpu_vllm_plan.steps(args, manifest)
    assert len(steps) == 8  # 7 wheel calls (the last installs and runs the first half), then the fleets
    assert sum(s["expected_s"] for s in steps) <= gpu_vllm_plan.DEVICE_BUDGET_S
    assert all(len(s["command"]) <= 2000 and 1 <= s["timeout_s"] <= 600 for s in steps)
    assert [s["carry"] for s in steps[:7]] == [[f".whl/calls/{c:02d}"] for c in range(1, 8)] and steps[7]["carry"] == []
    last_wheels, fleets = steps[6]["command"], steps[7]["command"]
    assert "gpu_wheels install" in last_wheels and "--phases build,ref,pd" in last_wheels
    assert "--phases fleets" in fleets and "--commit abc1234" in fleets
    for step in steps[6:]:  # the check stops inside the call's limit, so its records still come back
        cmd = step["command"]
        assert int(cmd.split("timeout ")[1].split()[0]) < step["timeout_s"]
        assert "$OUT/" in cmd and "PYTHONPATH=/tmp/site" in cmd
    text = gpu_vllm_plan.plan_text(args, manifest)
    assert "8 device calls" in text and "give_back" in text


def test_the_plan_flag_prints_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert check.main(["--plan", "--commit", "abc1234"]) == 0
    assert "timeout_s=" in capsys.readouterr().out


# ---------------------------------------------------------------- wheels
def _wheel(folder: Path, name: str, version: str, payload_bytes: int) -> Path:
    """A real (installable) wheel of one module holding ``payload_bytes`` of incompressible data."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    blob = hashlib.shake_256(name.encode()).digest(payload_bytes)
    files = {f"{name}/__init__.py": b"VALUE = 42\n", f"{name}/blob.bin": blob,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{k},,\n" for k in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{dist}/RECORD", record)
    return path


def test_pack_receive_install_round_trip(tmp_path):
    dl = tmp_path / "dl"
    dl.mkdir()
    big = _wheel(dl, "bigpkg", "1.0", 700_000)
    small = [_wheel(dl, f"small{i}", "0.1", 30_000) for i in range(3)]
    assert gpu_wheels.wheel_for("bigpkg==1.0", dl) == big
    manifest = gpu_wheels.pack([big, *small], tmp_path / "calls", budget_bytes=400_000, piece_bytes=300_000)
    calls = sorted((tmp_path / "calls").iterdir())
    assert manifest["calls"] == len(calls) >= 3
    for c in calls:  # each call's parts within its budget, the manifest in every call
        assert sum(p.stat().st_size for p in c.iterdir() if p.name != gpu_wheels.MANIFEST) <= 400_000 - 64 * 1024
        assert (c / gpu_wheels.MANIFEST).is_file()
    entry = next(e for e in manifest["files"] if e["file"] == big.name)
    assert len(entry["pieces"]) == 3 and len(entry["calls"]) == 3 and 0 not in entry["calls"]

    dest, site = tmp_path / "received", tmp_path / "site"
    for c in calls[:-1]:
        gpu_wheels.receive(c, dest)
    assert gpu_wheels.install(dest, site) == 1  # a part still missing: refused, nothing installed
    assert not site.exists()
    gpu_wheels.receive(calls[-1], dest)
    assert gpu_wheels.install(dest, site) == 0
    assert (site / "bigpkg" / "blob.bin").read_bytes() == zipfile.ZipFile(big).read("bigpkg/blob.bin")
    r = subprocess.run([sys.executable, "-c", "import bigpkg, small2; print(bigpkg.VALUE)"],
                       env={"PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert r.stdout.strip() == "42"


def test_a_corrupted_part_is_refused_by_name(tmp_path, capsys):
    dl = tmp_path / "dl"
    dl.mkdir()
    big = _wheel(dl, "bigpkg", "1.0", 500_000)
    gpu_wheels.pack([big], tmp_path / "calls", budget_bytes=400_000, piece_bytes=300_000)
    dest = tmp_path / "received"
    for c in sorted((tmp_path / "calls").iterdir()):
        gpu_wheels.receive(c, dest)
    part = dest / f"{big.name}.part00"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped in transit
    part.write_bytes(bytes(data))
    assert gpu_wheels.install(dest, tmp_path / "site") == 1
    assert f"{big.name}: size or sha256 differs" in capsys.readouterr().out


def test_the_wheel_calls_carry_one_folder_each_and_the_last_installs(tmp_path):
    manifest = {"calls": 3, "files": []}
    calls = gpu_wheels.plan(manifest, gpu_wheels.WHL / "calls", then="echo then")
    assert [c["carry"] for c in calls] == [[".whl/calls/01"], [".whl/calls/02"], [".whl/calls/03"]]
    assert "install" not in calls[0]["command"] and calls[-1]["command"].endswith("&& echo then")
    assert all(len(c["command"]) <= 2000 for c in calls)


def test_the_wheel_folder_is_ignored_by_git():
    for path in (".whl/dl/x.whl", ".whl/calls/01/x.whl.part00"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=procs.REPO).returncode == 0, path


def test_the_travel_list_pins_one_version_each():
    names = [gpu_wheels.canonical(p.split("==")[0]) for p in gpu_wheels.TRAVEL]
    assert len(names) == len(set(names)) and all("==" in p for p in gpu_wheels.TRAVEL)
    assert "vllm==0.26.0" in gpu_wheels.TRAVEL and not {"torch", "torchvision", "transformers"} & set(names)


# ---------------------------------------------------------------- records and the model
def test_records_are_checked_against_the_docs_schema(tmp_path):
    table = {"name": "handoff", "columns": ["a", "b"], "rows": [["x", 1]]}
    path = common.write_record(tmp_path, "gpu-test-vllm-pd", title="t", command="make gpu-vllm-check",
                              conditions="c", commit_hash="abc1234", tables=[table])
    rec = json.loads(path.read_text())
    assert rec["id"] == "gpu-test-vllm-pd" and rec["machine"]["gpu"] is None and rec["commit"] == "abc1234"
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        common.write_record(tmp_path, "gpu-test-bad", title="t", command="c", conditions="c", commit_hash="abc1234",
                           tables=[{"name": "t", "columns": ["a"], "rows": [["x", 1]]}])
    assert any("gpu-test-vllm-pd / handoff" in line for line in check.summary(tmp_path, {"pd": "ok"}))


def test_the_2b_size_has_qwen2_vl_2b_shapes():
    from shared.models.qwen2_vl_tiny import QWEN2_VL_2B, text_config_dict, vision_config_dict

    text = text_config_dict(1200, {"<|endoftext|>": 0, "<|im_end|>": 1}, QWEN2_VL_2B)
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"], text["num_key_value_heads"],
            text["intermediate_size"], text["vocab_size"]) == (1536, 28, 12, 2, 8960, 151936)
    assert QWEN2_VL_2B.head_dim == 128 and sum(QWEN2_VL_2B.mrope_section) == 64
    assert text["rope_parameters"]["rope_theta"] == 1e6 and text["max_position_embeddings"] == 32768
    vision = vision_config_dict(QWEN2_VL_2B)
    assert (vision["depth"], vision["embed_dim"], vision["num_heads"], vision["mlp_ratio"]) == (32, 1280, 16, 4)
    assert (QWEN2_VL_2B.save_dtype, QWEN2_VL_2B.build_device) == ("bfloat16", "cuda")
