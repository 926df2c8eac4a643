"""compose/observability.yml (Prometheus + Grafana), checked without a Docker engine.

- The fleet's file includes it, and its services pass the fleet file's own service checks.
- Prometheus discovers (Docker DNS) exactly the services running ``mmfleet worker`` / ``mmfleet
  gateway``, on the ports their effective settings serve /metrics; Grafana's provisioning wires
  the datasource, dashboard folder and home dashboard to what the compose file mounts.
- Every dashboard query parses and names only series the code exports (from the
  prometheus_client registry, never a hand list); every series ``/fleet`` reads has a panel.
  Mutation tests break a copy and expect the right complaint.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client import REGISTRY

from tests.compose.test_compose import (
    COMPOSE_DIR,
    COMPOSE_FILE,
    DOCKERFILE,
    as_list,
    check_services,
    effective_settings,
    mmfleet_args,
    ours,
    volumes_of,
)

REPO = COMPOSE_DIR.parent
OBS_FILE = COMPOSE_DIR / "observability.yml"
PROM_FILE = COMPOSE_DIR / "prometheus" / "prometheus.yml"
GRAFANA = COMPOSE_DIR / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "mmfleet.json"
SNAPSHOT_SOURCE = REPO / "services" / "fleetview" / "snapshot.py"
PROMETHEUS_OWN = {"up"}  # series Prometheus itself writes for every target
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum", "_created"),
             "summary": ("", "_count", "_sum", "_created"), "info": ("_info",), "unknown": ("",)}


def exported_series() -> set[str]:
    """Sample names every process can expose: import each module that defines series, then read
    the default registry (families with no samples yet still have a name and a type)."""
    for root in ("shared", "services"):
        for path in sorted((REPO / root).rglob("*.py")):
            text = path.read_text()
            if re.search(r"\b(Counter|Gauge|Histogram|Summary)\(\s*\"mmfleet_", text):
                importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
    return {fam.name + suffix for fam in REGISTRY.collect() for suffix in _SUFFIXES[fam.type]}


def _family(name: str) -> str:
    return re.sub(r"_(bucket|count|sum|created)$", "", name)


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: value}) of every vector selector in a PromQL expression."""
    out = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            matchers = node.matchers.matchers if node.matchers else []
            out.append((node.name, {m.name: m.value for m in matchers}))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return out


def targets(dashboard: dict):
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


# ----------------------------------------------------------------------------------- checks
def check_dashboard(dashboard: dict, datasource_uid: str, prom: dict) -> list[str]:
    problems, used = [], set()
    exported = exported_series() | PROMETHEUS_OWN
    jobs = {job["job_name"] for job in prom["scrape_configs"]}
    for panel, target in targets(dashboard):
        where = f"panel {panel['title']!r} {target.get('refId')}"
        if (target.get("datasource") or panel.get("datasource") or {}).get("uid") != datasource_uid:
            problems.append(f"{where}: datasource is not the provisioned {datasource_uid!r}")
        try:
            found = selectors(target["expr"])
        except (ValueError, RuntimeError) as exc:
            problems.append(f"{where}: PromQL does not parse: {exc}")
            continue
        if not found:
            problems.append(f"{where}: names no series")
        for name, labels in found:
            used.add(_family(name))
            if name not in exported:
                problems.append(f"{where}: {name} is not a series the code exports")
            if "job" in labels and labels["job"] not in jobs:
                problems.append(f"{where}: job {labels['job']!r} is not a scrape job of prometheus.yml")
    page = {_family(n) for n in re.findall(r"\"(mmfleet_[a-z0-9_]+)\"", SNAPSHOT_SOURCE.read_text())}
    for family in sorted(page - used):
        problems.append(f"the /fleet page shows {family} but no dashboard panel does")
    return problems


def check_scrape_config(prom: dict, fleet: dict) -> list[str]:
    """Every worker / gateway service of the fleet is discovered, on the port it serves /metrics."""
    problems = []
    dockerfile = DOCKERFILE.read_text()
    wanted: dict[str, int] = {}
    for name, svc in ours(fleet).items():
        try:
            command = mmfleet_args(svc).command
            settings = effective_settings(svc, dockerfile)
        except ValueError:
            continue  # reported by tests/compose/test_compose.py
        if command == "worker":
            wanted[name] = settings.metrics_port
        elif command == "gateway":
            wanted[name] = settings.gateway_port
    found: dict[str, int] = {}
    for job in prom["scrape_configs"]:
        if job.get("static_configs"):
            problems.append(f"job {job['job_name']}: static targets do not follow --scale; use dns_sd_configs")
        for sd in job.get("dns_sd_configs", []):
            if sd.get("type", "SRV") != "A":
                problems.append(f"job {job['job_name']}: Docker DNS answers type A, not {sd.get('type', 'SRV')}")
            for host in sd["names"]:
                found[host] = sd.get("port")
    for name, port in wanted.items():
        if name not in found:
            problems.append(f"service {name} serves /metrics but prometheus.yml does not discover it")
        elif found[name] != port:
            problems.append(f"service {name} serves /metrics on {port}, prometheus.yml scrapes {found[name]}")
    for name in sorted(set(found) - set(wanted)):
        problems.append(f"prometheus.yml discovers {name!r}, which is no mmfleet worker or gateway service")
    return problems


def _mount(svc: dict, source: str) -> str | None:
    return next((target for src, target in volumes_of(svc) if src and Path(src).parts == Path(source).parts), None)


def check_wiring(obs: dict, fleet: dict, datasources: dict, providers: dict) -> list[str]:
    problems = check_services({"services": {**fleet["services"], **obs["services"]},
                               "volumes": {**(fleet.get("volumes") or {}), **(obs.get("volumes") or {})}}, "")
    if OBS_FILE.name not in [i if isinstance(i, str) else i.get("path") for i in fleet.get("include") or []]:
        problems.append(f"docker-compose.yml does not include {OBS_FILE.name}")
    prom, graf = obs["services"].get("prometheus"), obs["services"].get("grafana")
    if prom is None or graf is None:
        return problems + ["observability.yml needs a prometheus and a grafana service"]
    config = next((a.split("=", 1)[1] for a in as_list(prom.get("command")) if a.startswith("--config.file=")), None)
    if config is None or _mount(prom, "./prometheus/prometheus.yml") != config:
        problems.append(f"prometheus reads {config}, where prometheus/prometheus.yml is not mounted")
    if _mount(graf, "./grafana/provisioning") != "/etc/grafana/provisioning":
        problems.append("grafana/provisioning is not mounted at /etc/grafana/provisioning")
    (source,) = datasources["datasources"]
    host, _, port = source["url"].split("://")[1].partition(":")
    if host not in obs["services"] or port != "9090":
        problems.append(f"the datasource url {source['url']} is not the prometheus service on 9090")
    dash_dir = _mount(graf, "./grafana/dashboards")
    if dash_dir is None or providers["providers"][0]["options"]["path"] != dash_dir:
        problems.append(f"the dashboard provider reads a folder where grafana/dashboards is not mounted ({dash_dir})")
    home = (graf.get("environment") or {}).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH", "")
    if dash_dir is None or not home.startswith(dash_dir + "/") or not (DASHBOARD.parent / Path(home).name).is_file():
        problems.append(f"the home dashboard {home!r} is not a file of grafana/dashboards")
    return problems


# ------------------------------------------------------------------------------------ tests
def _load():
    return {"obs": yaml.safe_load(OBS_FILE.read_text()), "fleet": yaml.safe_load(COMPOSE_FILE.read_text()),
            "prom": yaml.safe_load(PROM_FILE.read_text()), "dashboard": json.loads(DASHBOARD.read_text()),
            "datasources": yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text()),
            "providers": yaml.safe_load((GRAFANA / "provisioning/dashboards/mmfleet.yml").read_text())}


def problems_of(f: dict) -> list[str]:
    uid = f["datasources"]["datasources"][0]["uid"]
    return (check_dashboard(f["dashboard"], uid, f["prom"]) + check_scrape_config(f["prom"], f["fleet"])
            + check_wiring(f["obs"], f["fleet"], f["datasources"], f["providers"]))


def test_observability_files_pass_every_check():
    files = _load()
    assert len(list(targets(files["dashboard"]))) >= 20
    assert problems_of(files) == []


def _expr(i: int, expr: str):
    def go(f):
        list(targets(f["dashboard"]))[i][1]["expr"] = expr
    return go


MUTATIONS = [
    ("unknown series", _expr(1, "sum(rate(mmfleet_stage_record_total[1m]))"), "not a series the code exports"),
    ("histogram without _bucket", _expr(5, "histogram_quantile(0.5, sum by (le) (rate(mmfleet_ttft_seconds[1m])))"),
     "not a series the code exports"),
    ("bad PromQL", _expr(1, "sum(rate(mmfleet_stage_records_total[1m])"), "does not parse"),
    ("unknown job", _expr(0, 'sum(up{job="workers"})'), "not a scrape job"),
    ("panel dropped", lambda f: f["dashboard"]["panels"].__setitem__(
        slice(None), [p for p in f["dashboard"]["panels"]
                      if "mmfleet_consumer_lag_records" not in json.dumps(p)]), "no dashboard panel does"),
    ("other datasource", lambda f: f["datasources"]["datasources"][0].__setitem__("uid", "other"), "datasource"),
    ("worker not discovered", lambda f: f["prom"]["scrape_configs"][0]["dns_sd_configs"][0]["names"].remove("encode"),
     "does not discover it"),
    ("wrong port", lambda f: f["prom"]["scrape_configs"][0]["dns_sd_configs"][0].__setitem__("port", 9000),
     "scrapes 9000"),
    ("SRV lookups", lambda f: f["prom"]["scrape_configs"][1]["dns_sd_configs"][0].__setitem__("type", "SRV"),
     "type A"),
    ("not included", lambda f: f["fleet"].pop("include"), "does not include"),
    ("config elsewhere", lambda f: f["obs"]["services"]["prometheus"]["command"].__setitem__(
        0, "--config.file=/etc/prom.yml"), "prometheus reads"),
    ("datasource host", lambda f: f["datasources"]["datasources"][0].__setitem__("url", "http://prom:9090"),
     "datasource url"),
    ("provider path", lambda f: f["providers"]["providers"][0]["options"].__setitem__("path", "/dashboards"),
     "dashboard provider"),
    ("undeclared volume", lambda f: f["obs"].pop("volumes"), "not declared"),
]


@pytest.mark.parametrize("mutate, expected", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_each_observability_check_fires(mutate, expected):
    files = copy.deepcopy(_load())
    mutate(files)
    problems = problems_of(files)
    assert any(expected in p for p in problems), problems
