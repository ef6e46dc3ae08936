"""Settings of one SSE edge process."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from topics import BusSettings
from topics.settings import split_csv


class EdgeSettings(BaseSettings):
    """``TOKENBUS_EDGE_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_EDGE_", extra="ignore")

    bus: BusSettings = Field(default_factory=BusSettings)
    host: str = "127.0.0.1"
    port: int = 8700
    # The partitions of `tokens` this process owns; each edge process needs its own.
    reply_partitions: Annotated[list[int], NoDecode] = [0]
    default_tier: str = "standard"
    stream_idle_timeout_s: float = 60.0
    heartbeat_s: float = 15.0
    max_body_bytes: int = 1_000_000

    _split_partitions = field_validator("reply_partitions", mode="before")(split_csv)
