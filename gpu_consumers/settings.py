"""Settings of one GPU consumer process."""

from __future__ import annotations

import os
import socket

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from topics import BusSettings


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseSettings):
    """``TOKENBUS_WORKER_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_WORKER_", extra="ignore")

    bus: BusSettings = Field(default_factory=BusSettings)
    model: str = "tokenbus-sim"
    engine: str = "simulated"
    max_num_seqs: int = 64
    worker_id: str = Field(default_factory=default_worker_id)
    commit_interval_ms: int = 100
    host: str = "127.0.0.1"
    port: int = 8701  # /healthz and /metrics
