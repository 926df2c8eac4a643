"""deploy/k8s, offline: both overlays render (tests/k8s/render.py), every built-in object
validates against the Kubernetes 1.37 OpenAPI schemas bundled in ``kubernetes-validate``
(strict: unknown fields are errors), and what no bundled schema covers — the CRDs of Strimzi
(Kafka, KafkaNodePool) and KEDA (ScaledObject) — is checked against the code instead: each
stage's consumer group and topic, the bootstrap address, the autoscaling numbers, the
settings every pod would start with (the real parser and settings loader), the probes, and
grace periods above the drain timeout."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import kubernetes_validate
import pytest

from services.cli import _parser
from services.stages import BY_NAME as STAGES
from shared import settings as settings_mod
from shared.keys import consumer_group
from tests.k8s.render import containers, render

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.37.0"
CRDS = {("kafka.strimzi.io/v1beta2", "Kafka"), ("kafka.strimzi.io/v1beta2", "KafkaNodePool"),
        ("keda.sh/v1alpha1", "ScaledObject")}
IMAGES = {"cpu": "registry.example.com/mmfleet:cpu", "gpu": "registry.example.com/mmfleet:gpu"}


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def ours(docs: list[dict]) -> dict[str, dict]:
    """Deployments running the mmfleet image."""
    return {n: d for n, d in by_kind(docs, "Deployment").items()
            if any("mmfleet" in c["image"] for c in containers(d))}


def pod_settings(doc: dict, container: dict, docs: list[dict]) -> settings_mod.Settings:
    """What ``mmfleet`` in this container would run with: its ConfigMaps, then its env, then its flags."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env.update(by_kind(docs, "ConfigMap")[src["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "10.0.0.7")  # fieldRef status.podIP: some pod address
    args = _parser().parse_args(container["args"])
    overrides = {k: v for k, v in vars(args).items() if k in settings_mod.field_names()}
    return settings_mod.from_env(env, **overrides)


def test_builtin_objects_validate_against_the_kubernetes_schemas(overlay):
    name, docs = overlay
    kinds = set()
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        kubernetes_validate.validate(doc, VERSION, strict=True)  # raises ValidationError
        kinds.add(doc["kind"])
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "Job", "PodDisruptionBudget"} <= kinds
    assert {(d["apiVersion"], d["kind"]) for d in docs} - {(d["apiVersion"], d["kind"]) for d in docs
                                                            if (d["apiVersion"], d["kind"]) not in CRDS} <= CRDS


def test_the_validator_rejects_a_broken_deployment(overlay):
    _, docs = overlay
    broken = copy.deepcopy(by_kind(docs, "Deployment")["mmfleet-encode"])
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 10  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_one_deployment_per_stage_and_a_gateway_with_probes(overlay):
    name, docs = overlay
    deployments = ours(docs)
    stages = {}
    for dname, doc in deployments.items():
        pod = doc["spec"]["template"]["spec"]
        main = pod["containers"][0]
        assert all(c["image"] == IMAGES[name] for c in containers(doc)), dname
        settings = pod_settings(doc, main, docs)  # unknown MMFLEET_* / bad values raise here
        assert settings.advertise_host == "10.0.0.7", f"{dname}: pods must advertise their own address"
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
        for stage in ("encode", "prefill", "decode"):
            limits = deployments[f"mmfleet-{stage}"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert limits["nvidia.com/gpu"] == 1


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
