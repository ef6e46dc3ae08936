"""Shared fixtures: the real embedded stack (tansu broker, Redis, GPU consumer, edge)
started once per session on free ports, a three-broker Kafka-protocol cluster (librdkafka's
mock cluster, tests/kafka_cluster.py) for the bus tests that run on both, and a fresh topic
namespace per test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

from tests.kafka_cluster import MockKafkaCluster
from tests.redis_cluster import RedisCluster
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack, StackSettings
from tokenbus.moderation.policy import DEFAULT_POLICY_FILE
from tokenbus.stores.batches import BatchStore
from tokenbus.stores.files import FileStore
from tokenbus.stores.redis_client import RedisClient, redis_client
from tokenbus.topics import BusSettings, TopicCatalog, ensure_topics

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
# An OpenAI model's name, which the stack's edge serves with MODEL (TOKENBUS_EDGE_MODEL_ALIASES).
ALIAS = "gpt-4.1-mini"
# The stack's moderation policy: the default one, plus a phrase the simulated engine
# utters now and then, which output moderation blocks on the interactive tier only (no
# other test uses that tier on the stack, so no other stream is cut short).
SIM_PHRASE = "the edge"
TEST_POLICY = DEFAULT_POLICY_FILE.read_text() + f"""
[categories.sim_phrase]
phrases = ["{SIM_PHRASE}"]

[output_actions.interactive]
sim_phrase = "block"
"""


# Property tests have no deadline: hypothesis's default (200 ms an example) is a timed assert, and
# these machines run the same example several times slower on a slow spell.
hypothesis_settings.register_profile("tokenbus", deadline=None)
hypothesis_settings.load_profile("tokenbus")


def pytest_configure(config: pytest.Config) -> None:
    """A run started in the background by a non-interactive shell (`make test &` in a script)
    inherits SIGINT ignored, and an ignored signal stays ignored in every process the tests start:
    `tokenbus up` would never see the Ctrl-C its tests send (it waited forever in such a run). The
    tests stand in for a user at a terminal, so this process takes SIGINT as Python does by default,
    and a process started from here begins with it at the default (a handler does not survive exec)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    settings = StackSettings(
        run_root=tmp_path_factory.mktemp("run"),
        broker_port=free_port(),
        edge_port=free_port(),
        worker_port=free_port(),
        processors_port=free_port(),
        redis_url=os.environ.get("TOKENBUS_STACK_REDIS_URL", "redis://127.0.0.1:6379/0"),
        topic_prefix=unique_prefix(),
        redis_prefix=f"test-{uuid.uuid4().hex[:8]}:",
        models=[MODEL, SLOW_MODEL, UNSERVED_MODEL],
    )
    # Nobody serves UNSERVED_MODEL: its queues only grow, so its batch queue (3 at most) fills and
    # MODEL answers for it; its interactive queue sheds requests with tools from a depth of 2.
    # SLOW_MODEL has a small context window, for server-side history.
    edge_env = {"TOKENBUS_EDGE_DISCONNECT_GRACE_S": "1", "TOKENBUS_EDGE_KEY_CACHE_TTL_S": "0.5",
                "TOKENBUS_EDGE_MAX_QUEUE_DEPTH": "interactive:1000,standard:1000,batch:3",
                "TOKENBUS_EDGE_FALLBACK": f"{UNSERVED_MODEL}:{MODEL}", "TOKENBUS_EDGE_SHED_TOOLS_AT": "interactive:0.002",
                "TOKENBUS_EDGE_CONTEXT_WINDOWS": f"{SLOW_MODEL}:300", "TOKENBUS_EDGE_MODEL_ALIASES": f"{ALIAS}={MODEL}"}
    policy = settings.run_root / "policy.toml"
    policy.write_text(TEST_POLICY)
    processors_env = {"TOKENBUS_MODERATION_POLICY_FILE": str(policy), "TOKENBUS_PROC_BILLING_BATCH_S": "0.2"}
    embedded = EmbeddedStack(settings, extra_env={**SIM_ENV, **edge_env, **processors_env})
    slow_env = {f"TOKENBUS_SIM_{k.upper()}": str(v) for k, v in SLOW_SETTINGS.model_dump().items()}
    try:
        embedded.start(worker_env={SLOW_MODEL: slow_env}, unserved=(UNSERVED_MODEL,))
        yield embedded
    finally:
        embedded.stop()


@contextlib.contextmanager
def own_stack(stack: EmbeddedStack, run_root: Path, models: list[str], extra_env: dict[str, str],
              worker_env: dict[str, dict[str, str]] | None = None) -> Iterator[EmbeddedStack]:
    """A whole stack of its own (broker, services, topics), for a test that kills or reconfigures
    what the session's stack shares."""
    settings = stack.settings.model_copy(update={
        "run_root": run_root, "topic_prefix": unique_prefix(), "broker_port": free_port(), "edge_port": free_port(),
        "worker_port": free_port(), "processors_port": free_port(), "models": models})
    own = EmbeddedStack(settings, extra_env={**SIM_ENV, **extra_env})
    try:
        own.start(worker_env=worker_env)
        yield own
    finally:
        own.stop()


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
    settings = stack.bus_settings().model_copy(update={"topic_prefix": unique_prefix(), "models": [MODEL]})
    asyncio.run(ensure_topics(settings.bootstrap_servers, TopicCatalog(settings).all_topics()))
    return settings


@pytest.fixture
def embedded(bus: BusSettings) -> BusSettings:
    """``bus`` with the embedded broker's client profile (doorbell, express lane, pacing)."""
    assert bus.doorbell_url, "the test stack runs Redis, so its bus has a doorbell"
    return bus.model_copy(update={"broker": "embedded"})


@pytest.fixture(params=["server", "cluster"])
async def each_redis(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RedisClient, str]]:
    """A client of the real Redis, one server and then a three-primary Redis Cluster, and a key
    prefix of its own (its keys are removed after)."""
    cluster = request.param == "cluster"
    url = request.getfixturevalue("redis_cluster").url if cluster else "redis://127.0.0.1:6379/0"
    client = redis_client(url, cluster)
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    yield client, prefix
    async for key in client.scan_iter(f"{prefix}*"):
        await client.delete(key)
    await client.aclose()


@pytest.fixture
async def batch_stores() -> AsyncIterator[tuple[BatchStore, FileStore]]:
    """The batch and file stores on the real Redis, under a prefix of their own (removed after)."""
    client = redis_client("redis://127.0.0.1:6379/0")
    prefix = f"test-batches-{uuid.uuid4().hex[:8]}:"
    yield BatchStore(client, prefix, ttl_s=60), FileStore(client, prefix, ttl_s=60)
    async for key in client.scan_iter(f"{prefix}*"):
        await client.delete(key)
    await client.aclose()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A real three-primary Redis Cluster (tests/redis_cluster.py)."""
    with RedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def kafka_cluster() -> Iterator[MockKafkaCluster]:
    with MockKafkaCluster(brokers=3) as cluster:
        yield cluster


@pytest.fixture(params=["embedded", "kafka"])
def each_bus(request: pytest.FixtureRequest) -> BusSettings:
    """Like ``bus``, once on the embedded broker and once on a three-broker Kafka cluster (the
    mock cluster, with the client settings a real Kafka cluster gets): for the tests of what the
    bus itself must guarantee, so that nothing holds only on one broker."""
    if request.param == "embedded":
        return request.getfixturevalue("bus")
    cluster: MockKafkaCluster = request.getfixturevalue("kafka_cluster")
    settings = BusSettings(bootstrap_servers=cluster.bootstrap_servers, broker="kafka",
                           topic_prefix=unique_prefix(), models=[MODEL])
    cluster.create_topics(TopicCatalog(settings).all_topics())
    return settings


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path
