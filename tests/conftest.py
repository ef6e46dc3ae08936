"""Shared fixtures: the real embedded stack (tansu broker, Redis, GPU consumer, edge)
started once per session on free ports, and a fresh topic namespace per test."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_consumers.engines import SimulatedEngineSettings
from infra.processes import free_port
from infra.stack import EmbeddedStack, StackSettings
from topics import BusSettings, TopicCatalog, ensure_topics

# The simulated engine every stack process runs; tests rebuild it in-process to know
# exactly which tokens a request must produce.
SIM_SETTINGS = SimulatedEngineSettings(seed=7, ttft_ms=10, tokens_per_s=400, min_tokens=4, max_tokens=40)
SIM_ENV = {f"TOKENBUS_SIM_{name.upper()}": str(value) for name, value in SIM_SETTINGS.model_dump().items()}
MODEL = "tokenbus-sim"
# A second model whose engine is slow and long-winded, for streams that must still be running
# when a test disconnects or resumes them; and a model no consumer serves, whose queue only grows.
SLOW_MODEL = "tokenbus-slow"
SLOW_SETTINGS = SimulatedEngineSettings(seed=3, ttft_ms=5, tokens_per_s=50, min_tokens=300, max_tokens=300)
UNSERVED_MODEL = "tokenbus-unserved"


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    settings = StackSettings(
        run_root=tmp_path_factory.mktemp("run"),
        broker_port=free_port(),
        edge_port=free_port(),
        worker_port=free_port(),
        redis_url=os.environ.get("TOKENBUS_STACK_REDIS_URL", "redis://127.0.0.1:6379/0"),
        topic_prefix=unique_prefix(),
        redis_prefix=f"test-{uuid.uuid4().hex[:8]}:",
        models=[MODEL, SLOW_MODEL, UNSERVED_MODEL],
    )
    edge_env = {"TOKENBUS_EDGE_DISCONNECT_GRACE_S": "1", "TOKENBUS_EDGE_KEY_CACHE_TTL_S": "0.5",
                "TOKENBUS_EDGE_MAX_QUEUE_DEPTH": "interactive:1000,standard:1000,batch:3"}
    embedded = EmbeddedStack(settings, extra_env={**SIM_ENV, **edge_env})
    slow_env = {f"TOKENBUS_SIM_{k.upper()}": str(v) for k, v in SLOW_SETTINGS.model_dump().items()}
    try:
        embedded.start(worker_env={SLOW_MODEL: slow_env}, unserved=(UNSERVED_MODEL,))
        yield embedded
    finally:
        embedded.stop()


@pytest.fixture
def edge_url(stack: EmbeddedStack) -> str:
    return stack.edge_url


@pytest.fixture
def api_key(stack: EmbeddedStack) -> str:
    """The stack's dev key (tenant "dev", tier "standard", no limits)."""
    return stack.dev_key


@pytest.fixture
def auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture
def bus(stack: EmbeddedStack) -> BusSettings:
    """Bus settings on the session's broker with topics of their own, so tests never share data."""
    settings = BusSettings(bootstrap_servers=stack.bootstrap_servers, topic_prefix=unique_prefix(), models=[MODEL])
    asyncio.run(ensure_topics(settings.bootstrap_servers, TopicCatalog(settings).all_topics()))
    return settings


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path
