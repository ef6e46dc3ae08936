"""The deployment files (infra/deploy/) are checked as files, with no Docker or cluster: the
compose file against the compose-spec schema (as check-jsonschema ships it) and the Kubernetes
manifests against the official client's models; every TOKENBUS_* variable they set against the
services' settings classes; every address against the services and the ports they expose;
every image against a pinned version; KEDA's triggers against the topic catalog."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml
from pydantic_settings import BaseSettings

from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings
from tokenbus.gpu_consumers.engines.simulated import SimulatedEngineSettings
from tokenbus.gpu_consumers.engines.trtllm import TrtLlmEngineSettings
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.moderation import ModerationSettings
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.stores.billing.clickhouse import ClickHouseSettings
from tokenbus.stores.transcripts import TranscriptSettings
from tokenbus.stream_processors.settings import ProcessorSettings
from tokenbus.topics import BusSettings, TopicCatalog

DEPLOY = Path(__file__).parents[2] / "infra" / "deploy"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
SETTINGS: list[type[BaseSettings]] = [BusSettings, EdgeSettings, WorkerSettings, ProcessorSettings, TranscriptSettings,
                                      ClickHouseSettings, ModerationSettings, SimulatedEngineSettings, HfEngineSettings,
                                      TrtLlmEngineSettings]
INTERPOLATION = re.compile(r"\$\{([A-Z_]+):-([^}]*)\}")


def settings_variables() -> set[str]:
    """Every environment variable a settings class reads (nested settings read their own)."""
    names = set()
    for cls in SETTINGS:
        prefix = cls.model_config.get("env_prefix", "")
        for name, field in cls.model_fields.items():
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseSettings)):
                names.add(f"{prefix}{name}".upper())
    return names


@pytest.fixture(scope="module")
def compose() -> dict:
    # Compose's own interpolation, with the defaults: ${NAME:-default}.
    return yaml.safe_load(INTERPOLATION.sub(lambda m: m.group(2), COMPOSE.read_text()))


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    return {str(k): str(v) for k, v in env.items()}


def test_the_compose_file_follows_the_compose_spec(compose):
    schema = json.loads(resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
                        .read_text())
    jsonschema.validators.validator_for(schema)(schema).validate(compose)
    broken = dict(compose, services={**compose["services"], "edge-1": {**compose["services"]["edge-1"], "expose": 8700}})
    with pytest.raises(jsonschema.ValidationError):  # the check does catch a wrong shape
        jsonschema.validators.validator_for(schema)(schema).validate(broken)


def test_every_tokenbus_variable_is_read_by_a_settings_class(compose):
    known = settings_variables()
    assert {"TOKENBUS_EDGE_PORT", "TOKENBUS_BOOTSTRAP_SERVERS", "TOKENBUS_PROC_JOBS"} <= known
    unknown = {f"{name}: {var}" for name, service in compose["services"].items()
               for var in environment(service) if var.startswith("TOKENBUS_") and var not in known}
    assert not unknown, f"variables no settings class reads: {sorted(unknown)}"


def addresses(service: dict) -> list[tuple[str, int]]:
    """(host, port) of every other service a tokenbus service's settings name."""
    env = environment(service)
    found = []
    for var, value in env.items():
        if var == "TOKENBUS_BOOTSTRAP_SERVERS":
            found += [(host, int(port)) for host, port in (item.split(":") for item in value.split(","))]
        elif var.endswith("_URL"):
            url = urlparse(value)
            found.append((url.hostname or "", url.port or 80))
        elif var == "TOKENBUS_TRANSCRIPTS_CASSANDRA_CONTACT_POINTS":
            port = int(env.get("TOKENBUS_TRANSCRIPTS_CASSANDRA_PORT", "9042"))
            found += [(host, port) for host in value.split(",")]
    return found


def test_every_address_names_a_service_on_a_port_it_exposes(compose):
    services = compose["services"]
    exposed = {name: {int(p) for p in service.get("expose", [])} for name, service in services.items()}
    references = [(name, host, port) for name, service in services.items() for host, port in addresses(service)]
    nginx = (DEPLOY / "compose" / "nginx.conf").read_text()
    references += [("proxy", host, int(port)) for host, port in re.findall(r"server ([\w-]+):(\d+);", nginx)]
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    references += [("prometheus", *target.split(":")) for job in prometheus["scrape_configs"]
                   for config in job["static_configs"] for target in config["targets"]]
    assert len(references) > 20
    wrong = [f"{source} -> {host}:{port}" for source, host, port in references
             if host not in services or int(port) not in exposed[host]]
    assert not wrong, f"addresses that name no service, or a port it does not expose: {wrong}"
    for name, service in services.items():  # and each tokenbus service listens where it says it does
        env = environment(service)
        for var in ("TOKENBUS_EDGE_PORT", "TOKENBUS_WORKER_PORT", "TOKENBUS_PROC_PORT"):
            if var in env:
                assert int(env[var]) in exposed[name], f"{name} listens on {env[var]} but exposes {exposed[name]}"


def test_every_image_is_pinned(compose):
    for name, service in compose["services"].items():
        image = service.get("image", "")
        repository, _, tag = image.rpartition(":")
        assert repository and tag and tag != "latest" and re.search(r"\d", tag), f"{name}: {image!r} is not pinned"
    assert re.search(r"^FROM \S+:\d[\w.-]*", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE)


def test_the_dashboard_is_provisioned_from_the_file_the_tests_check(compose):
    volumes = compose["services"]["grafana"]["volumes"]
    assert any(v.startswith("../grafana/tokenbus.json:") for v in volumes)
    assert (COMPOSE.parent / "../grafana/tokenbus.json").resolve() == (DEPLOY / "grafana" / "tokenbus.json").resolve()


# -- Kubernetes (kustomize) --------------------------------------------------------------------

KUBERNETES = DEPLOY / "kubernetes"
MODELS = {"Namespace": "V1Namespace", "ConfigMap": "V1ConfigMap", "Secret": "V1Secret", "Job": "V1Job",
          "StatefulSet": "V1StatefulSet", "Deployment": "V1Deployment", "Service": "V1Service",
          "HorizontalPodAutoscaler": "V2HorizontalPodAutoscaler", "PodDisruptionBudget": "V1PodDisruptionBudget"}


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files, "kustomization lists every manifest"
    return [doc for name in files for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def pods(manifests: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every workload."""
    return [(doc, doc["spec"]["template"]["spec"]) for doc in manifests if doc["kind"] in ("Deployment", "StatefulSet",
                                                                                              "Job")]


def test_every_manifest_is_what_the_kubernetes_api_reads(manifests):
    """Read into the official client's models and written back: a field the API does not know,
    or a value of the wrong type, does not survive the round trip."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    kinds = set()
    for doc in manifests:
        if doc["kind"] == "ScaledObject":
            continue  # KEDA's: checked below
        model = api._ApiClient__deserialize(doc, MODELS[doc["kind"]])  # the client's own reader
        assert api.sanitize_for_serialization(model) == doc, f"{doc['kind']} {doc['metadata']['name']}"
        kinds.add(doc["kind"])
    assert kinds == set(MODELS)
    with pytest.raises(AssertionError):  # the round trip does catch a misspelt field
        bad = {**manifests[0], "metadata": {**manifests[0]["metadata"], "lables": {"a": "b"}}}
        assert api.sanitize_for_serialization(api._ApiClient__deserialize(bad, MODELS[bad["kind"]])) == bad


def test_kubernetes_variables_images_ports_and_shutdown_agree_with_tokenbus(manifests):
    known = settings_variables()
    config = next(d for d in manifests if d["kind"] == "ConfigMap")["data"]
    secret = next(d for d in manifests if d["kind"] == "Secret")["stringData"]
    variables = set(config) | set(secret)
    for _, pod in pods(manifests):
        for container in pod["containers"]:
            variables |= {e["name"] for e in container.get("env", [])}
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            ports = {p["containerPort"] for p in container.get("ports", [])}
            for var in ("TOKENBUS_EDGE_PORT", "TOKENBUS_WORKER_PORT", "TOKENBUS_PROC_PORT"):
                if var in env:
                    assert int(env[var]) in ports
    assert not {v for v in variables if v.startswith("TOKENBUS_")} - known
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    pinned = {i["name"] for i in kustomization["images"] if re.fullmatch(r"\d[\w.-]*", i.get("newTag", ""))}
    assert {c["image"] for _, pod in pods(manifests) for c in pod["containers"]} <= pinned

    edge = next(d for d in manifests if d["kind"] == "StatefulSet")
    container = edge["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert edge["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > float(env["TOKENBUS_EDGE_SHUTDOWN_GRACE_S"])
    hpa = next(d for d in manifests if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == edge["metadata"]["name"]
    per_edge = int(env["TOKENBUS_EDGE_REPLY_PARTITIONS_PER_ORDINAL"])
    assert hpa["spec"]["maxReplicas"] * per_edge <= int(config["TOKENBUS_TOKEN_PARTITIONS"])  # every edge its own
    for service in (d for d in manifests if d["kind"] == "Service"):
        selected = [w for w, _ in pods(manifests)
                    if service["spec"]["selector"].items() <= w["spec"]["template"].get("metadata", {})
                    .get("labels", {}).items()]
        assert selected, f"service {service['metadata']['name']} selects no pods"


def test_gpu_consumers_take_a_gpu_and_keda_follows_their_groups_lag(manifests):
    config = next(d for d in manifests if d["kind"] == "ConfigMap")["data"]
    bus = BusSettings(models=config["TOKENBUS_MODELS"].split(","), tiers=config["TOKENBUS_TIERS"].split(","))
    catalog = TopicCatalog(bus)
    for scaled in (d for d in manifests if d["kind"] == "ScaledObject"):
        target = next(d for d in manifests if d["kind"] == "Deployment"
                      and d["metadata"]["name"] == scaled["spec"]["scaleTargetRef"]["name"])
        container = target["spec"]["template"]["spec"]["containers"][0]
        model = next(e["value"] for e in container["env"] if e["name"] == "TOKENBUS_WORKER_MODEL")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        triggers = scaled["spec"]["triggers"]
        assert {t["type"] for t in triggers} == {"kafka"}
        assert {t["metadata"]["consumerGroup"] for t in triggers} == {catalog.gpu_group(model)}
        assert sorted(t["metadata"]["topic"] for t in triggers) == sorted(catalog.model_request_topics(model))
        assert all(t["metadata"]["bootstrapServers"] == config["TOKENBUS_BOOTSTRAP_SERVERS"] for t in triggers)
        assert scaled["spec"]["maxReplicaCount"] <= int(config["TOKENBUS_REQUEST_PARTITIONS"])
