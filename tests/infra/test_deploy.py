"""The deployment files (infra/deploy/) are checked as files, with no Docker: the compose file
against the compose-spec schema (as check-jsonschema ships it), every TOKENBUS_* variable it
sets against the services' settings classes, every address it names against the services and
the ports they expose, and every image against a pinned version."""

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

from tokenbus.gpu_consumers.engines.hf import HfEngineSettings
from tokenbus.gpu_consumers.engines.simulated import SimulatedEngineSettings
from tokenbus.gpu_consumers.engines.trtllm import TrtLlmEngineSettings
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.moderation import ModerationSettings
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.stores.billing.clickhouse import ClickHouseSettings
from tokenbus.stores.transcripts import TranscriptSettings
from tokenbus.stream_processors.settings import ProcessorSettings
from tokenbus.topics import BusSettings

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
