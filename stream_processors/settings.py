"""Settings of one stream-processor worker (``TOKENBUS_PROC_*``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tokenbus.moderation import ModerationSettings
from tokenbus.stores.billing.clickhouse import ClickHouseSettings
from tokenbus.stores.transcripts import TranscriptSettings
from tokenbus.topics import BusSettings
from tokenbus.topics.collector import GC_THRESHOLD
from tokenbus.topics.event_loops import EventLoop
from tokenbus.topics.settings import split_csv

JOBS = ("moderation", "transcripts", "billing", "batches")


class ProcessorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENBUS_PROC_", extra="ignore")

    bus: BusSettings = Field(default_factory=BusSettings)
    transcripts: TranscriptSettings = Field(default_factory=TranscriptSettings)
    clickhouse: ClickHouseSettings = Field(default_factory=ClickHouseSettings)
    moderation: ModerationSettings = Field(default_factory=ModerationSettings)
    # The consumer group is `<topic prefix><app_id>`; workers sharing it share the partitions.
    app_id: str = "processors"
    # Which jobs this worker runs: moderation, transcripts, billing (ClickHouse: usage and decisions),
    # batches (each batch request's outcome, kept in Redis for the edge's Batch API).
    jobs: Annotated[list[str], NoDecode] = list(JOBS)
    # The Redis the edges keep batches in (TOKENBUS_EDGE_REDIS_*): the batches job writes there.
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False
    redis_prefix: str = "tokenbus:"
    host: str = "127.0.0.1"
    port: int = 8702
    loop: EventLoop = "auto"  # topics/event_loops.py
    gc_threshold: int = GC_THRESHOLD  # topics/collector.py
    # faust's own state (table metadata; the tables themselves are in memory). Unset: faust's
    # default, `<group>-data` in the working directory.
    data_dir: Path | None = None
    prices_file: Path | None = None
    # Billing inserts when this many completions are waiting, or this long after the first.
    # ClickHouse asks for inserts of 1,000 rows or more, or about one a second: each insert makes
    # a part in every table its materialized views feed (in chDB, 25-60 ms of CPU whatever its size).
    billing_batch_size: int = 1000
    billing_batch_s: float = 1.0
    # Requests the ingress agent moderates at once: each waits for two broker acks, and one at a
    # time caps a worker at a few hundred requests/s. (Requests of one conversation may then
    # reach their request topic in another order; offsets still commit only past finished ones.)
    ingress_concurrency: int = 8
    # faust asks the broker to hold fetches 1.5 s; unset, the bus profile's wait (topics/clients.py):
    # Kafka's 500 ms, or a few ms on the embedded broker, where the ingress hop would wait ~750 ms.
    fetch_max_wait_ms: int | None = None
    # On the embedded broker, output moderation reads the rolled reply logs with this fetch wait
    # rather than the request path's few ms: a truncation lands ~10 ms later on average, and the
    # broker, which holds each fetch that finds nothing for all of its wait, gets a quarter of the
    # fetches (BENCHMARKS.md §1); while the express lane brings every event, the profile's express
    # wait instead. Kafka long-polls, so there it reads like every other reader.
    output_moderation_fetch_wait_ms: int = 20
    retry_max_delay_s: float = 5.0

    _split_jobs = field_validator("jobs", mode="before")(split_csv)

    @field_validator("jobs")
    @classmethod
    def _known_jobs(cls, jobs: list[str]) -> list[str]:
        unknown = sorted(set(jobs) - set(JOBS))
        if unknown:
            raise ValueError(f"unknown jobs {unknown}; choose from {list(JOBS)}")
        return jobs

    @property
    def group_id(self) -> str:
        return f"{self.bus.topic_prefix}{self.app_id}"
