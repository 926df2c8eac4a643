"""deploy/k8s, offline, checked as a cluster would take it: both overlays render (tests/k8s/render.py;
where kustomize is on PATH, its rendering must be the same objects), every object validates
(tests/k8s/validate.py: the Kubernetes 1.37 schemas of ``kubernetes-validate`` for the built-in
kinds, the vendored Strimzi and KEDA schemas for the custom ones, strict), and what no schema
can say is checked against the code: each stage's consumer group and topic, the bootstrap
address, the autoscaling numbers, the settings every pod would start with (its image's ENV,
its ConfigMaps, its env and its flags, through the real parser and settings loader: so a GPU
image on a pod that runs no model shows), the probes, Redis's persistence, and grace periods
above the drain timeout. tests/k8s/test_pods.py starts the pods' commands."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from services.cli import _parser
from services.stages import BY_NAME as STAGES
from shared import settings as settings_mod
from shared.keys import consumer_group
from tests.compose.test_compose import image_env
from tests.k8s.render import containers, kustomize_binary, render, render_kustomize
from tests.k8s.validate import Invalid, validate

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
CPU_IMAGE, GPU_IMAGE = "registry.example.com/mmfleet:cpu", "registry.example.com/mmfleet:gpu"
# the image each tag is built from (docs/deploy/kubernetes.md): its ENV is part of every pod's settings
DOCKERFILES = {CPU_IMAGE: REPO / "compose" / "Dockerfile", GPU_IMAGE: REPO / "compose" / "Dockerfile.gpu"}
ENGINE_STAGES = ("encode", "prefill", "decode")  # the stages that run a model on a device
POD_IP = "10.0.0.7"  # what a fieldRef status.podIP gives: some pod address


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def ours(docs: list[dict]) -> dict[str, dict]:
    """Deployments running the mmfleet image."""
    return {n: d for n, d in by_kind(docs, "Deployment").items()
            if any("mmfleet" in c["image"] for c in containers(d))}


def pod_env(container: dict, docs: list[dict]) -> dict[str, str]:
    """The environment ``mmfleet`` in this container starts with: its image's ENV (the runtime's
    variables and settings), then its ConfigMaps, then its env."""
    env = {k: v for k, v in image_env(DOCKERFILES[container["image"]].read_text()).items()
           if k.startswith(settings_mod.ENV_PREFIX) or k in ("HF_HUB_OFFLINE", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")}
    for src in container.get("envFrom", []):
        env.update(by_kind(docs, "ConfigMap")[src["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", POD_IP)
    return env


def pod_settings(container: dict, docs: list[dict]) -> settings_mod.Settings:
    """What ``mmfleet`` in this container would run with: :func:`pod_env`, then its flags."""
    args = _parser().parse_args(container["args"])
    overrides = {k: v for k, v in vars(args).items() if k in settings_mod.field_names()}
    return settings_mod.from_env(pod_env(container, docs), **overrides)


def _mmfleet_pods(docs: list[dict]) -> dict[str, dict]:
    """Every workload that runs the mmfleet image: the Deployments and the topics Job."""
    return {**ours(docs), **by_kind(docs, "Job")}


def stage_of(doc: dict) -> str | None:
    args = _parser().parse_args(doc["spec"]["template"]["spec"]["containers"][0]["args"])
    return args.stages if args.command == "worker" else None


def test_every_object_validates_as_a_cluster_would(overlay):
    _, docs = overlay
    for doc in docs:
        validate(doc)  # raises Invalid naming the object and the field
    assert {"Namespace", "ConfigMap", "Deployment", "StatefulSet", "Service", "Job", "PodDisruptionBudget",
            "Kafka", "KafkaNodePool", "ScaledObject"} <= {d["kind"] for d in docs}


def _break(kind: str, name: str, path: tuple, value):
    def mutate(docs: list[dict]) -> dict:
        doc = copy.deepcopy(by_kind(docs, kind)[name])
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return doc
    return mutate


@pytest.mark.parametrize("mutate", [
    _break("Deployment", "mmfleet-encode", ("spec", "template", "spec", "containers", 0, "livenessProbe",
                                            "periodSecond"), 10),  # a typo: unknown field
    _break("StatefulSet", "mmfleet-redis", ("spec", "replicas"), "one"),
    _break("Kafka", "mmfleet", ("spec", "kafka", "listeners", 0, "tsl"), False),
    _break("Kafka", "mmfleet", ("spec", "kafka", "listeners", 0, "type"), "internel"),
    _break("KafkaNodePool", "dual-role", ("spec", "roles"), ["controller", "brokers"]),
    _break("KafkaNodePool", "dual-role", ("spec", "storage", "volumes", 0, "size"), 20),
    _break("ScaledObject", "mmfleet-encode", ("spec", "minReplicaCounts"), 1),
    _break("ScaledObject", "mmfleet-encode", ("spec", "triggers", 0, "metadata", "lagThreshold"), 8),
], ids=["deployment typo", "statefulset type", "kafka typo", "kafka enum", "nodepool enum", "nodepool type",
        "scaledobject typo", "scaledobject type"])
def test_the_validators_reject_what_a_cluster_would(overlay, mutate):
    _, docs = overlay
    with pytest.raises(Invalid):
        validate(mutate(docs))


def test_a_kind_without_a_schema_is_an_error():
    with pytest.raises(Invalid, match="no schema"):
        validate({"apiVersion": "kafka.strimzi.io/v1beta2", "kind": "KafkaTopic", "metadata": {"name": "t"}})


def test_kustomize_renders_the_objects_the_tests_check(overlay):
    name, docs = overlay
    command = kustomize_binary()
    if command is None:
        pytest.skip("no kustomize here (kubectl kustomize or a kustomize binary): tests/k8s/render.py alone")

    def key(d: dict) -> tuple:
        return d["apiVersion"], d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]

    theirs = {key(d): d for d in render_kustomize(command, K8S / "overlays" / name)}
    assert theirs == {key(d): d for d in docs}


def test_one_deployment_per_stage_and_a_gateway_with_probes(overlay):
    name, docs = overlay
    deployments = ours(docs)
    stages = {}
    for dname, doc in deployments.items():
        pod = doc["spec"]["template"]["spec"]
        main = pod["containers"][0]
        settings = pod_settings(main, docs)  # unknown MMFLEET_* / bad values raise here
        assert settings.advertise_host == POD_IP, f"{dname}: pods must advertise their own address"
        assert pod["terminationGracePeriodSeconds"] > settings.drain_timeout_ms / 1000, dname
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert probe in main, f"{dname} has no {probe}"
        args = _parser().parse_args(main["args"])
        if args.command == "worker":
            stages[args.stages] = dname
            assert main["livenessProbe"]["httpGet"]["port"] == "metrics"
            assert {p["name"]: p["containerPort"] for p in main["ports"]}["metrics"] == settings.metrics_port
        else:
            assert args.command == "gateway", dname
            assert main["livenessProbe"]["httpGet"]["path"] == "/health"
            assert main["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert settings.gateway_host == "0.0.0.0"
            service = by_kind(docs, "Service")[dname]
            assert service["spec"]["selector"] == doc["spec"]["selector"]["matchLabels"]
            assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert sorted(stages) == sorted(STAGES), stages
    if name == "gpu":
        for stage in ENGINE_STAGES:
            limits = deployments[f"mmfleet-{stage}"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert limits["nvidia.com/gpu"] == 1


def test_only_the_pods_that_run_a_model_are_on_the_gpu_image_and_device(overlay):
    """The GPU image sets MMFLEET_DEVICE=cuda, and a worker asked for a GPU it cannot see
    refuses to start: media-fetch, the gateway and the topics Job stay on the CPU image."""
    name, docs = overlay
    for pname, doc in _mmfleet_pods(docs).items():
        engine = stage_of(doc) in ENGINE_STAGES
        gpu = name == "gpu" and engine
        limits = doc["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        assert ("nvidia.com/gpu" in limits) == gpu, pname
        for c in containers(doc):  # an init container (`mmfleet model`) on the pod's image, computing nothing
            assert c["image"] == (GPU_IMAGE if gpu else CPU_IMAGE), (pname, c["name"])
        main = doc["spec"]["template"]["spec"]["containers"][0]
        assert pod_settings(main, docs).device == ("cuda" if gpu else "cpu"), pname


def test_the_gpu_overlay_serves_its_model_under_its_own_name(overlay):
    name, docs = overlay
    for pname, doc in ours(docs).items():
        for c in containers(doc):
            s = pod_settings(c, docs)
            if name == "gpu":
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                assert s.model == "/models/served" and "/models" in mounts, (pname, c["name"])
                assert s.served_model_name == s.model, (pname, c["name"], s.served_model_name)
            else:
                assert (s.model, s.served_model_name) == ("", "mmfleet-demo"), (pname, c["name"])


def redis_problems(docs: list[dict]) -> list[str]:
    """Redis must keep an append-only file on a volume that outlives the pod (see redis.yaml)."""
    (redis,) = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                and any(c["image"].startswith("redis") for c in containers(d))]
    (c,) = containers(redis)
    argv = c.get("args", [])
    value = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    problems = []
    if value.get("--appendonly") != "yes":
        problems.append("no append-only file: done-marks, dedupe records and token logs die with Redis")
    data_dir = value.get("--dir", "/data")
    claims = {t["metadata"]["name"] for t in redis["spec"].get("volumeClaimTemplates", [])}
    if not any(m["mountPath"] == data_dir and m["name"] in claims for m in c.get("volumeMounts", [])):
        problems.append(f"{data_dir} is not on a persistent volume claim")
    return problems


def test_redis_keeps_an_append_only_file_on_a_persistent_volume(overlay):
    _, docs = overlay
    assert redis_problems(docs) == []
    broken = copy.deepcopy(docs)
    (redis,) = [d for d in broken if d["kind"] == "StatefulSet"]
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--appendonly") + 1] = "no"
    redis["spec"].pop("volumeClaimTemplates")
    assert len(redis_problems(broken)) == 2


def test_every_deployment_has_a_disruption_budget(overlay):
    _, docs = overlay
    pdbs = by_kind(docs, "PodDisruptionBudget")
    for dname, doc in ours(docs).items():
        assert pdbs[dname]["spec"]["selector"]["matchLabels"] == doc["spec"]["selector"]["matchLabels"], dname


def test_kafka_is_strimzi_kraft_and_every_bootstrap_names_it(overlay):
    _, docs = overlay
    (kafka,) = by_kind(docs, "Kafka").values()
    (pool,) = by_kind(docs, "KafkaNodePool").values()
    assert kafka["metadata"]["annotations"] == {"strimzi.io/node-pools": "enabled", "strimzi.io/kraft": "enabled"}
    assert set(pool["spec"]["roles"]) == {"controller", "broker"}
    assert pool["metadata"]["labels"]["strimzi.io/cluster"] == kafka["metadata"]["name"]
    (listener,) = kafka["spec"]["kafka"]["listeners"]
    bootstrap = f"{kafka['metadata']['name']}-kafka-bootstrap:{listener['port']}"  # Strimzi's Service name
    (config,) = by_kind(docs, "ConfigMap").values()
    assert config["data"]["KAFKA_BOOTSTRAP"] == bootstrap
    for so in by_kind(docs, "ScaledObject").values():
        kafka_triggers = [t for t in so["spec"]["triggers"] if t["type"] == "kafka"]
        assert [t["metadata"]["bootstrapServers"] for t in kafka_triggers] == [bootstrap]


def test_a_scaled_object_per_stage_on_its_lag_and_the_ttft_slo(overlay):
    _, docs = overlay
    defaults = settings_mod.Settings()
    deployments = ours(docs)
    (config,) = by_kind(docs, "ConfigMap").values()
    partitions = int(config["data"]["MMFLEET_TOPIC_PARTITIONS"])
    scaled = by_kind(docs, "ScaledObject")
    assert sorted(scaled) == sorted(f"mmfleet-{s}" for s in STAGES)
    for stage, topic in ((s.name, s.topic) for s in STAGES.values()):
        so = scaled[f"mmfleet-{stage}"]["spec"]
        target = deployments[so["scaleTargetRef"]["name"]]
        assert _parser().parse_args(target["spec"]["template"]["spec"]["containers"][0]["args"]).stages == stage
        assert defaults.autoscale_min_workers <= so["minReplicaCount"] <= so["maxReplicaCount"] <= partitions
        (lag,) = [t["metadata"] for t in so["triggers"] if t["type"] == "kafka"]
        assert (lag["consumerGroup"], lag["topic"]) == (consumer_group(stage), topic)
        assert int(lag["lagThreshold"]) == defaults.autoscale_lag_per_worker
        down = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] == math.ceil(defaults.autoscale_scale_down_after_s)
        assert down["policies"][0] == {"type": "Pods", "value": 1, "periodSeconds": down["stabilizationWindowSeconds"]}
        ttft = [t["metadata"] for t in so["triggers"] if t["type"] == "prometheus"]
        if stage in ("prefill", "decode"):
            assert "mmfleet_ttft_seconds_bucket" in ttft[0]["query"]
            assert float(ttft[0]["threshold"]) == defaults.autoscale_ttft_slo_ms / 1000
        else:
            assert not ttft
