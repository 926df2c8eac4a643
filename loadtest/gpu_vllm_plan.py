"""The vLLM GPU check's device plan (``python -m loadtest.gpu_vllm_check --plan``): every device
call in order with its ``carry``, command, ``timeout_s`` and expected time, within the 15 minutes
a task is lent. The wheel calls come from ``.whl/calls``' manifest (``python -m loadtest.gpu_wheels
prepare``), else from an estimate. Docs: docs/deploy/gpus.md.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from loadtest import gpu_vllm_common as common
from loadtest import gpu_wheels

DEVICE_BUDGET_S = 15 * 60
START_S = 120  # a fresh machine, at the first call (60-120 s)
PART_CALL_S = 25  # one part call: ~64 MiB up, a copy, and the gap to the next call (< 30 s)
INSTALL_S = 40  # reassemble + sha256 (~5 s) and pip install --target (~30 s)
RESULTS = "/tmp/gpu-vllm"  # on the device: both check calls share it (the second reads the first's references)
# the preflight's probes all recur in the phases: on the device it is left out (add it when a
# first run fails in a way the CPU rehearsal cannot show)
FIRST = ("build", "ref", "pd")
SECOND = ("fleets",)


@dataclass(frozen=True)
class Check:
    """One GPU check as the plan runs it: ``groups[0]`` in the installing call, each later group a call."""
    title: str
    module: str
    results: str  # on the device, shared by its calls
    groups: tuple[tuple[str, ...], ...]
    phases: dict  # name -> gpu_vllm_common.Phase
    calls_dir: Path
    estimate_calls: int  # wheel calls before `prepare` has packed them
    flags: object = None  # args -> extra check flags ("" by default)
    prepare: str = "python -m loadtest.gpu_wheels prepare"
    install_s: int = INSTALL_S


VLLM = Check("vLLM GPU check", "loadtest.gpu_vllm_check", RESULTS, (FIRST, SECOND), common.PHASES,
             gpu_wheels.WHL / "calls", 7, flags=lambda args: " --cuda-graphs" if args.cuda_graphs else "")


def steps(args: argparse.Namespace, manifest: dict | None = None, check: Check = VLLM) -> list[dict]:
    """The calls: ``{"what", "carry", "command", "timeout_s", "expected_s"}``."""
    if manifest is None:
        manifest = _manifest(check)
    calls = manifest["calls"] if manifest else check.estimate_calls
    rel = check.calls_dir.relative_to(gpu_wheels.REPO)
    wheel_calls = gpu_wheels.plan(manifest, check.calls_dir) if manifest else [
        {"carry": [f"{rel}/{c:02d}"], "command": f"python3 -m loadtest.gpu_wheels receive {rel}/{c:02d}"}
        for c in range(1, calls + 1)]
    out = [{"what": f"wheel part call {c} of {calls}" + (f" (+ ~{START_S} s: the machine starts)" if c == 1 else ""),
            "carry": call["carry"], "command": call["command"], "timeout_s": 120,
            "expected_s": PART_CALL_S + (START_S if c == 1 else 0)} for c, call in enumerate(wheel_calls[:-1], 1)]
    # --phases leaves phases out of the plan (a group left empty: no call of its own)
    first, *rest = (tuple(p for p in group if p in args.phases) for group in check.groups)
    rest = [group for group in rest if group]
    last = wheel_calls[-1]
    run_first = _check_command(args, check, first, 540 - check.install_s - 40) if first else "true"
    install = (f"python3 -m loadtest.gpu_wheels receive {last['carry'][0]} && python3 -m loadtest.gpu_wheels install"
               f" && export {gpu_wheels.env_line()} && {run_first}")
    out.append({"what": f"wheel part call {calls} of {calls}: reassemble, sha256, install; then "
                        + ", ".join(first), "carry": last["carry"], "command": install,
                "timeout_s": 540, "expected_s": PART_CALL_S + check.install_s + _expected(check, first)})
    out += [{"what": "the check: " + ", ".join(group), "carry": [],
             "command": f"export {gpu_wheels.env_line()} && {_check_command(args, check, group, 540)}",
             "timeout_s": 570, "expected_s": _expected(check, group)} for group in rest]
    return out


def _check_command(args: argparse.Namespace, check: Check, phases: tuple[str, ...], limit_s: int) -> str:
    """One check call: the phases, stopped after ``limit_s`` (inside the call's timeout_s, so the
    records still reach $OUT), then the results into $OUT."""
    flags = check.flags(args) if check.flags else ""
    tag = phases[0]
    results = check.results
    return (f"export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1; timeout {limit_s} python3 -m {check.module} "
            f"--phases {','.join(phases)} --out {results} --commit {args.commit or common.commit()}{flags}; rc=$?; "
            f"tar czf $OUT/{Path(results).name}-{tag}.tgz -C {results} --exclude='*.pt' .; exit $rc")


def _expected(check: Check, phases: tuple[str, ...]) -> int:
    return sum(check.phases[p].expected_s for p in phases)


def _manifest(check: Check = VLLM) -> dict | None:
    path = check.calls_dir / "01" / gpu_wheels.MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def plan_text(args: argparse.Namespace, manifest: dict | None = None, check: Check = VLLM) -> str:
    found = manifest if manifest is not None else _manifest(check)
    rows = steps(args, found, check)
    total = sum(r["expected_s"] for r in rows)
    head = [f"{check.title}: {len(rows)} device calls, ~{total // 60} min {total % 60} s expected of the "
            f"{DEVICE_BUDGET_S // 60} min lent. Each call must follow the last within {gpu_wheels.WARM_WINDOW_S} s "
            "(a machine idle longer goes back, /tmp with it: then start again from call 1)."]
    if total > DEVICE_BUDGET_S:
        head.append(f"DOES NOT FIT: {total - DEVICE_BUDGET_S} s over the {DEVICE_BUDGET_S // 60} min lent")
    if not found:
        head.append(f"(no {check.calls_dir.relative_to(gpu_wheels.REPO)} yet: run `{check.prepare}` here first; the "
                    "wheel calls below are an estimate)")
    body = []
    for i, r in enumerate(rows, 1):
        body += [f"# {i}. {r['what']} — expected ~{r['expected_s']} s, timeout_s={r['timeout_s']}, "
                 f"carry={json.dumps(r['carry'])}", r["command"], ""]
    tail = ["Then give_back. If a call fails: a receive call, run it again; install refused (a part lost), run "
            "the calls it names; a check call, run it again with the phases that did not pass "
            f"(--phases ...), the references in {check.results} stay while the machine is warm."]
    return "\n".join([*head, "", *body, *tail])
