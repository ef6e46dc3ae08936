"""Settings of one GPU consumer process."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tokenbus.gpu_consumers.engines.tool_calls import TOOL_PARSERS
from tokenbus.topics import BusSettings
from tokenbus.topics.collector import GC_THRESHOLD
from tokenbus.topics.event_loops import EventLoop
from tokenbus.topics.settings import split_csv


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseSettings):
    """``TOKENBUS_WORKER_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_WORKER_", extra="ignore")

    bus: BusSettings = Field(default_factory=BusSettings)
    model: str = "tokenbus-sim"
    engine: str = "simulated"
    worker_id: str = Field(default_factory=default_worker_id)
    max_num_seqs: int = 64
    # Token budget of running sequences: prompt tokens + max_tokens (or default_max_tokens) each.
    max_tokens_in_flight: int = 262_144
    default_max_tokens: int = 512
    # Admission weights, in the order of TOKENBUS_TIERS (highest tier first).
    tier_weights: Annotated[list[float], NoDecode] = [16.0, 4.0, 1.0]
    # Fetched-but-waiting requests per tier; past it that tier's partitions pause.
    prefetch_per_tier: int = 256
    takeover_clock_skew_ms: int = 2000
    # How the model writes function calls (engines/tool_calls.py); "hermes" is <tool_call>{json}</tool_call>.
    tool_parser: Literal[tuple(TOOL_PARSERS)] = "hermes"  # type: ignore[valid-type]
    commit_interval_ms: int = 100
    # A sequence's token events at most this often: the steps in between go out as one event with
    # all their tokens (its first token never waits). Each event costs every reader of the stream
    # (edge, output moderation, broker) about the same whatever it carries, so fewer events are
    # less CPU per token everywhere, at the price of a coarser stream. 0: an event per step.
    stream_interval_ms: int = Field(default=0, ge=0)
    # KV-cache-aware routing (TOKENBUS_PREFIX_ROUTING): what the engine caches is reported at most
    # this often, and in full (a snapshot, also the worker's heartbeat to routers) this often.
    cache_report_interval_ms: int = 100
    cache_snapshot_interval_s: float = 10.0
    host: str = "127.0.0.1"
    port: int = 8701  # /healthz and /metrics
    loop: EventLoop = "auto"  # topics/event_loops.py
    gc_threshold: int = GC_THRESHOLD  # topics/collector.py

    _split_weights = field_validator("tier_weights", mode="before")(split_csv)

    def weight_of(self) -> dict[str, float]:
        weights = list(self.tier_weights) + [1.0] * len(self.bus.tiers)
        return dict(zip(self.bus.tiers, weights))
