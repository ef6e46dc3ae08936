"""The embedded stack: broker, Redis, topics, GPU consumer(s) and edge(s) on one machine.

``tokenbus up`` and the test suite both use it, so what the tests exercise is what a
newcomer runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import redis.asyncio as redis
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tokenbus.infra.devstack.broker import broker_argv
from tokenbus.infra.devstack.processes import ManagedProcess, StartupError, free_port, port_open, serves, wait_until
from tokenbus.infra.devstack.redis_server import redis_answers, redis_server_argv
from tokenbus.stores.keys import KeyStore, Limits
from tokenbus.topics import BusSettings, TopicCatalog, ensure_topics
from tokenbus.topics.settings import split_csv

# The stack's own edge rotates through the upper half of `tokens`; extra edges and clients that
# tests and benchmarks start take single partitions below it.
MAIN_EDGE_REPLY_PARTITIONS = "8-23"


class StackSettings(BaseSettings):
    """``TOKENBUS_STACK_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_STACK_", extra="ignore")

    run_root: Path = Path(".run")
    host: str = "127.0.0.1"
    broker_port: int = 9092
    edge_port: int = 8700
    worker_port: int = 8701
    processors_port: int = 8702
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "tokenbus:"
    engine: str = "simulated"
    topic_prefix: str = "tokenbus."
    models: Annotated[list[str], NoDecode] = ["tokenbus-sim"]
    startup_timeout_s: float = 180.0  # the hf engine converts SmolLM2 on its first start (~35 s)
    # The stream processors' niceness. On one machine they share its cores with the request path
    # (edge, GPU consumer, broker), and nothing they do is on a token's way to its client: billing,
    # transcripts and audit records can wait out a burst and catch up after it (BENCHMARKS.md §1).
    # 0 runs them at the same priority as the rest.
    processors_nice: int = Field(default=10, ge=0, le=19)

    _split_models = field_validator("models", mode="before")(split_csv)


class EmbeddedStack:
    def __init__(self, settings: StackSettings | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings or StackSettings()
        self.extra_env = extra_env or {}
        self.processes: dict[str, ManagedProcess] = {}
        self.run_dir = self.settings.run_root / time.strftime("%Y%m%d-%H%M%S")
        self.dev_key = ""
        self.with_redis = True  # until a stack is started without it

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.settings.host}:{self.settings.broker_port}"

    @property
    def edge_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.edge_port}"

    def bus_settings(self) -> BusSettings:
        return BusSettings(
            bootstrap_servers=self.bootstrap_servers,
            broker="embedded",
            # Idle readers stop fetching and writers wake them through Redis (topics/doorbell.py);
            # a stack started without Redis polls instead.
            doorbell_url=self.settings.redis_url if self.with_redis else None,
            topic_prefix=self.settings.topic_prefix,
            models=self.settings.models,
        )

    @property
    def transcripts_path(self) -> Path:
        return self.settings.run_root / "transcripts.sqlite3"

    @property
    def clickhouse_path(self) -> Path:
        return self.settings.run_root / "clickhouse"

    @property
    def processors_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.processors_port}"

    def bus_env(self) -> dict[str, str]:
        """What every service is told: the bus, and where the embedded stores live (they
        outlast a run: the bus is in memory, transcripts and billing are not)."""
        bus = self.bus_settings()
        return {
            **self.extra_env,
            "TOKENBUS_BOOTSTRAP_SERVERS": bus.bootstrap_servers,
            "TOKENBUS_BROKER": bus.broker,
            **({"TOKENBUS_DOORBELL_URL": bus.doorbell_url} if bus.doorbell_url else {}),
            "TOKENBUS_TOPIC_PREFIX": bus.topic_prefix,
            "TOKENBUS_MODELS": ",".join(bus.models),
            "TOKENBUS_TIERS": ",".join(bus.tiers),
            "TOKENBUS_TRANSCRIPTS_SQLITE_PATH": str(self.transcripts_path.resolve()),
            "TOKENBUS_CLICKHOUSE_URL": f"chdb://{self.clickhouse_path.resolve()}",
        }

    def start(self, worker_env: dict[str, dict[str, str]] | None = None, unserved: tuple[str, ...] = ()) -> None:
        """``worker_env`` adds environment for one model's worker; ``unserved`` models get none (tests)."""
        self.start_bus()
        port = self.settings.worker_port
        for model in self.settings.models:
            if model in unserved:
                continue
            self.start_worker(f"gpu-consumer-{model}", port, model=model, env=(worker_env or {}).get(model))
            port = free_port()
        self.start_processors("processors", self.settings.processors_port)
        self.start_edge("edge", self.settings.edge_port, reply_partitions=MAIN_EDGE_REPLY_PARTITIONS)
        self.dev_key = asyncio.run(self.create_key("dev", "standard"))
        self._write_pids()

    async def create_key(self, tenant: str, tier: str, models: tuple[str, ...] = (), limits: Limits = Limits(),
                         fallback: bool = True, admin: bool = False) -> str:
        """A key in the stack's Redis; only its hash is stored, so this is the one time it is seen."""
        client = redis.Redis.from_url(self.settings.redis_url)
        try:
            key, _ = await KeyStore(client, self.settings.redis_prefix).create(tenant, tier, models, limits, fallback,
                                                                               admin)
        finally:
            await client.aclose()
        return key

    def start_bus(self, redis: bool = True) -> None:
        """The broker, Redis and the topics: what every service needs first. Without ``redis``,
        only the bus (a GPU consumer alone needs no Redis; a GPU host may have none)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._point_current_at_run_dir()
        self.start_broker()
        self.with_redis = redis
        if redis:
            self.ensure_redis()
        asyncio.run(ensure_topics(self.bootstrap_servers, TopicCatalog(self.bus_settings()).all_topics()))

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, nice: int = 0) -> ManagedProcess:
        if name in self.processes and self.processes[name].alive():
            raise StartupError(f"{name} is already running")
        process = ManagedProcess(name, argv, self.run_dir / f"{name}.log", env or {}, nice)
        process.start()
        self.processes[name] = process
        return process

    def start_broker(self) -> ManagedProcess:
        host, port = self.settings.host, self.settings.broker_port
        if port_open(host, port):
            raise StartupError(f"port {port} is taken: is another broker running? (`tokenbus down`)")
        broker = self._spawn("broker", broker_argv(host, port))
        wait_until(lambda: port_open(host, port), f"the broker on {host}:{port}", broker, timeout=20)
        return broker

    def ensure_redis(self) -> None:
        url = self.settings.redis_url
        if redis_answers(url):
            return
        redis = self._spawn("redis", redis_server_argv(url))
        wait_until(lambda: redis_answers(url), f"Redis at {url}", redis, timeout=20)

    def start_worker(self, name: str, port: int, model: str | None = None, env: dict[str, str] | None = None) -> ManagedProcess:
        worker_env = {
            **self.bus_env(),
            "TOKENBUS_WORKER_MODEL": model or self.settings.models[0],
            "TOKENBUS_WORKER_ENGINE": self.settings.engine,
            "TOKENBUS_WORKER_HOST": self.settings.host,
            "TOKENBUS_WORKER_PORT": str(port),
            "TOKENBUS_WORKER_WORKER_ID": name,
            # Every service shares this machine: a CPU model leaves two cores to the broker, the edge
            # and the processors (torch's spinning threads would starve them otherwise).
            "TOKENBUS_HF_CPU_THREADS": os.environ.get("TOKENBUS_HF_CPU_THREADS", str(max(1, (os.cpu_count() or 2) - 2))),
            **(env or {}),
        }
        worker = self._spawn(name, [sys.executable, "-m", "tokenbus.gpu_consumers"], worker_env)
        url = f"http://{self.settings.host}:{port}/healthz"
        wait_until(lambda: serves(url, worker.pid), f"{name} to join its group", worker, self.settings.startup_timeout_s)
        return worker

    def start_processors(self, name: str, port: int, env: dict[str, str] | None = None) -> ManagedProcess:
        """The faust worker: moderation, transcripts, billing and batches (one process owns chDB's directory)."""
        processors_env = {
            **self.bus_env(),
            "TOKENBUS_PROC_HOST": self.settings.host,
            "TOKENBUS_PROC_PORT": str(port),
            "TOKENBUS_PROC_DATA_DIR": str(self.run_dir / f"{name}-data"),
            "TOKENBUS_PROC_REDIS_URL": self.settings.redis_url,
            "TOKENBUS_PROC_REDIS_PREFIX": self.settings.redis_prefix,
            **(env or {}),
        }
        processors = self._spawn(name, [sys.executable, "-m", "tokenbus.stream_processors"], processors_env,
                                 nice=self.settings.processors_nice)
        url = f"http://{self.settings.host}:{port}/healthz"
        wait_until(lambda: serves(url, processors.pid), f"{name} on port {port}", processors, self.settings.startup_timeout_s)
        return processors

    def start_edge(self, name: str, port: int, reply_partitions: str = "0", env: dict[str, str] | None = None) -> ManagedProcess:
        edge_env = {
            **self.bus_env(),
            "TOKENBUS_EDGE_REDIS_URL": self.settings.redis_url,
            "TOKENBUS_EDGE_REDIS_PREFIX": self.settings.redis_prefix,
            "TOKENBUS_EDGE_HOST": self.settings.host,
            "TOKENBUS_EDGE_PORT": str(port),
            "TOKENBUS_EDGE_REPLY_PARTITIONS": reply_partitions,
            "TOKENBUS_EDGE_USAGE_URL": self.processors_url,
            **(env or {}),
        }
        edge = self._spawn(name, [sys.executable, "-m", "tokenbus.sse_edge"], edge_env)
        url = f"http://{self.settings.host}:{port}/healthz"
        wait_until(lambda: serves(url, edge.pid), f"{name} on port {port}", edge, self.settings.startup_timeout_s)
        return edge

    def _point_current_at_run_dir(self) -> None:
        current = self.settings.run_root / "current"
        if current.is_symlink() or current.exists():
            current.unlink()
        current.symlink_to(self.run_dir.name)

    def _write_pids(self) -> None:
        pids = {name: p.pid for name, p in self.processes.items()}
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=2))


def stop_recorded(run_root: Path) -> list[str]:
    """Stop the processes a ``tokenbus up`` recorded (for ``tokenbus down``); returns their names."""
    pids_file = run_root / "current" / "pids.json"
    if not pids_file.exists():
        return []
    stopped = []
    for name, pid in json.loads(pids_file.read_text()).items():
        try:
            os.killpg(pid, signal.SIGTERM)
            stopped.append(name)
        except ProcessLookupError:
            pass
    pids_file.unlink()
    return stopped
