"""The overlays' pods started on this machine as their containers would run them: each container's
``mmfleet`` arguments under its environment (its image's ENV, its ConfigMaps, its env:
``test_manifests.pod_env``), with only what a node provides put in: this test's broker and Redis,
the pod's address (127.0.0.1), free ports for the container ports (every pod shares this one
host) and local folders for the volumes. The CPU overlay: the topics Job, the init containers,
then every worker and the gateway until each one's readiness probe passes (the gateway's
``/ready``: a request of each kind can be answered), then a request of each kind. The GPU
overlay's pods that run no model (media-fetch, the gateway, the Job) start where no GPU is: the
worker becomes ready, and the gateway's ``/ready`` answers 503 naming the engine stages."""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from loadtest.procs import spawn, stop_group
from tests import procs
from tests.k8s.render import containers, render
from tests.k8s.test_manifests import K8S, by_kind, ours, pod_env, stage_of

READY_TIMEOUT_S = 300
BASE_ENV = ("PATH", "HOME", "LANG", "TMPDIR")  # what the runtime of any container has
CACHE_DIR = procs.REPO / ".mmfleet" / "cache"  # where tests/conftest.py builds the demo model: the emptyDir here


class Node:
    """Where the pods run: the broker, a Redis database, volumes by name, a folder for logs."""

    def __init__(self, kafka_bootstrap: str, redis_url: str, volumes: dict[str, Path], log_dir: Path) -> None:
        self.kafka_bootstrap, self.redis_url, self.volumes, self.log_dir = kafka_bootstrap, redis_url, volumes, log_dir
        self.procs: list = []
        self.ran: set[tuple] = set()

    def env(self, container: dict, docs: list[dict], ports: dict[int, int]) -> dict[str, str]:
        env = pod_env(container, docs)
        env.update({"KAFKA_BOOTSTRAP": self.kafka_bootstrap, "REDIS_URL": self.redis_url})
        env.update({v["name"]: "127.0.0.1" for v in container.get("env", []) if "valueFrom" in v})  # status.podIP
        mounts = sorted(((m["mountPath"], self.volumes[m["name"]]) for m in container.get("volumeMounts", [])),
                        key=lambda m: -len(m[0]))
        for key, value in env.items():
            if key.endswith("_HOST") and value == "0.0.0.0":
                env[key] = "127.0.0.1"  # the pod's own address: nothing here listens beyond this host
            elif key.endswith("_PORT") and value.isdigit() and int(value) in ports:
                env[key] = str(ports[int(value)])
            else:
                env[key] = next((str(local) + value[len(path):] for path, local in mounts
                                 if value == path or value.startswith(path + "/")), value)
        return {**{k: os.environ[k] for k in BASE_ENV if k in os.environ}, **env}

    def run(self, name: str, container: dict, docs: list[dict], timeout_s: float = 240) -> None:
        """A container that runs to completion (a Job's, an init container): exit 0. Containers of
        the same arguments and environment (every pod's identical init container) run once."""
        env = self.env(container, docs, {})
        key = (tuple(container["args"]), tuple(sorted(env.items())))
        if key in self.ran:
            return
        proc = spawn([sys.executable, "-m", "services.cli", *container["args"]], env=env,
                           log_path=self.log_dir / f"{name}.log", cwd=procs.REPO)
        try:
            assert proc.wait(timeout_s) == 0, (self.log_dir / f"{name}.log").read_text()[-3000:]
        finally:
            stop_group(proc)
        self.ran.add(key)

    def start(self, name: str, doc: dict, docs: list[dict]) -> dict[str, int]:
        """The pod's init containers, then its main container in the background; its port names
        -> the local ports they are on."""
        for c in doc["spec"]["template"]["spec"].get("initContainers", []):
            self.run(f"{name}-{c['name']}", c, docs)
        main = doc["spec"]["template"]["spec"]["containers"][0]
        ports = {p["containerPort"]: procs.free_port() for p in main.get("ports", [])}
        proc = spawn([sys.executable, "-m", "services.cli", *main["args"]], env=self.env(main, docs, ports),
                           log_path=self.log_dir / f"{name}.log", cwd=procs.REPO)
        self.procs.append((name, proc))
        return {p["name"]: ports[p["containerPort"]] for p in main.get("ports", [])}

    def get(self, name: str, probe: dict, named_ports: dict[str, int]) -> tuple[int, dict | None]:
        """One httpGet probe: (status, JSON body or None); (0, None) when nothing answers."""
        for pname, proc in self.procs:
            if proc.poll() is not None:
                raise AssertionError(f"{pname} exited with {proc.returncode}:\n"
                                     + (self.log_dir / f"{pname}.log").read_text()[-3000:])
        get = probe["httpGet"]
        port = named_ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{get['path']}", timeout=5) as resp:
                return resp.status, _json(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())
        except OSError:
            return 0, None

    def until(self, name: str, probe: dict, named_ports: dict[str, int], want, timeout_s: float = READY_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while True:
            status, body = self.get(name, probe, named_ports)
            if want(status, body):
                return status, body
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: {probe['httpGet']['path']} answered {status} {body} for "
                                     f"{timeout_s} s; logs in {self.log_dir}")
            time.sleep(0.5)

    def stop(self) -> None:
        for _, proc in self.procs:
            stop_group(proc)
        self.procs.clear()


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


@pytest.fixture
def node(kafka_bootstrap, redis_url, model_dir, tmp_path_factory, request):
    models = tmp_path_factory.mktemp("models")
    (models / "served").symlink_to(model_dir)  # the GPU overlay's model claim, holding a model
    db = {"cpu": 3, "gpu": 4}[request.param]  # each overlay's run a Redis of its own
    n = Node(kafka_bootstrap, redis_url.rsplit("/", 1)[0] + f"/{db}",
             {"model-cache": CACHE_DIR, "model": models}, tmp_path_factory.mktemp(f"pods-{request.param}"))
    try:
        yield request.param, render(K8S / "overlays" / request.param), n
    finally:
        n.stop()


def _chat(port: int, model: str, content) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _image_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 80, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("node", ["cpu"], indirect=True)
def test_the_cpu_overlays_pods_start_become_ready_and_answer(node, model_dir):
    _, docs, n = node
    for name, job in by_kind(docs, "Job").items():
        for c in containers(job):
            n.run(name, c, docs)
    started = {name: (doc, n.start(name, doc, docs)) for name, doc in ours(docs).items()}
    for name, (doc, ports) in started.items():
        probe = doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
        status, body = n.until(name, probe, ports, lambda status, _body: status == 200)
        if stage_of(doc) is None:  # the gateway: ready means every stage has a live worker
            assert body["status"] == "ready" and body["missing_stages"] == [], body
    gateway = started["mmfleet-gateway"][1]["http"]
    for content in ("Say hi.", [{"type": "image_url", "image_url": {"url": _image_url()}},
                                {"type": "text", "text": "What colour is it?"}]):
        reply = _chat(gateway, "mmfleet-demo", content)
        assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] > 0, reply


@pytest.mark.parametrize("node", ["gpu"], indirect=True)
def test_the_gpu_overlays_cpu_pods_start_without_a_gpu(node):
    _, docs, n = node
    for name, job in by_kind(docs, "Job").items():
        for c in containers(job):
            n.run(name, c, docs)
    cpu_pods = {name: doc for name, doc in ours(docs).items() if stage_of(doc) in (None, "media-fetch")}
    assert sorted(cpu_pods) == ["mmfleet-gateway", "mmfleet-media-fetch"]
    started = {name: (doc, n.start(name, doc, docs)) for name, doc in cpu_pods.items()}
    fetch_doc, fetch_ports = started["mmfleet-media-fetch"]
    n.until("mmfleet-media-fetch", fetch_doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"],
            fetch_ports, lambda status, _body: status == 200)
    gw_doc, gw_ports = started["mmfleet-gateway"]
    main = gw_doc["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "livenessProbe"):
        n.until("mmfleet-gateway", main[probe], gw_ports, lambda status, _body: status == 200)
    # not ready, and rightly: no engine pod runs here; media-fetch's worker is seen
    status, body = n.until("mmfleet-gateway", main["readinessProbe"], gw_ports,
                           lambda _status, body: (body or {}).get("missing_stages") == ["encode", "prefill", "decode"])
    assert status == 503 and body["workers"]["media-fetch"] == 1, body
