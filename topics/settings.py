"""Bus settings shared by every service: where the broker is and how topics are named."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def csv_items(value: str) -> list[str]:
    """``"a, b,,c"`` as ``["a", "b", "c"]``."""
    return [part.strip() for part in value.split(",") if part.strip()]


def split_csv(value: object) -> object:
    """A pydantic ``before`` validator: a comma-separated environment variable as a list."""
    return csv_items(value) if isinstance(value, str) else value


class BusSettings(BaseSettings):
    """``TOKENBUS_*`` environment variables. Client settings default to a real Kafka cluster;
    the embedded stack sets ``broker=embedded`` (topics/clients.py says what changes)."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_", extra="ignore", populate_by_name=True)

    bootstrap_servers: str = "127.0.0.1:9092"
    # Which kind of broker the clients are tuned for: `kafka` (Kafka and anything that long-polls
    # like it) or `embedded` (the single-process broker of `tokenbus up`).
    broker: Literal["kafka", "embedded"] = "kafka"
    # Redis for the embedded broker's doorbell (topics/doorbell.py): idle readers stop fetching
    # and writers wake them. Unused with `kafka`, which long-polls.
    doorbell_url: str | None = None
    # With the doorbell, the edge also hands each request, and GPU consumers each request's first
    # token event (at light load every one), to its readers through it once the broker has
    # acknowledged it (the express lane, topics/doorbell.py). Its first name is still read.
    express_lane: bool = Field(
        default=True, validation_alias=AliasChoices("TOKENBUS_EXPRESS_LANE", "TOKENBUS_EXPRESS_FIRST_TOKEN"))
    topic_prefix: str = "tokenbus."
    # Models served, and tiers from highest priority to lowest.
    models: Annotated[list[str], NoDecode] = ["tokenbus-sim"]
    tiers: Annotated[list[str], NoDecode] = ["interactive", "standard", "batch"]
    # On a Kafka cluster (not the embedded broker): copies of each partition, and how many must
    # have a write before it is acknowledged (producers use acks=all there).
    replication_factor: int = 3
    min_insync_replicas: int = 2
    # Token streams are kept as long as streams are resumable (the edge's TOKENBUS_EDGE_STREAM_TTL_S);
    # completions as long as billing may be replayed from them.
    token_retention_ms: int = 86_400_000
    completion_retention_ms: int = 7 * 86_400_000
    # Where every service sends its OpenTelemetry spans (an OTLP/HTTP collector's base address,
    # e.g. http://otel-collector:4318); unset, nothing is traced (topics/tracing.py).
    otlp_endpoint: str | None = None
    # A schema registry with Confluent's REST API (e.g. http://registry:8081; credentials in the
    # address are sent as basic auth): records are then written in Confluent's wire format, which
    # ClickHouse's AvroConfluent, Kafka Connect and ksqlDB read, under subjects named by record
    # type (topics/framing.py). Set it for every service of a bus: each reads both framings, but a
    # reader without a registry cannot read the registry's. Unset: Avro single-object encoding.
    schema_registry_url: str | None = None
    # Register a schema a subject lacks (the registry checks its compatibility with the subject's
    # versions), or only look the ids up, where a deployment step registers them.
    schema_registry_auto_register: bool = True
    # KV-cache-aware routing: GPU consumers report what their engines cache on `kvcache`, and
    # whatever places requests (the edge, the ingress processor, the SDK with a policy) sends each
    # to the consumer holding the longest prefix of its prompt (producers/placement.py). Off: GPU
    # consumers report nothing and requests are placed by conversation, as before.
    prefix_routing: bool = True
    request_partitions: int = 4
    # Reply partitions: edges own disjoint sets and rotate through them (topics/replies.py).
    token_partitions: int = 24
    # On the embedded broker edges roll their reply logs instead (a topic per rotation): a rolled
    # log is deleted this long after it took its last new stream, so its streams stay resumable
    # that long there (TOKENBUS_EDGE_STREAM_TTL_S is how long they are on a Kafka cluster).
    rolled_reply_log_keep_s: float = 600.0
    service_partitions: int = 4

    _split_models = field_validator("models", "tiers", mode="before")(split_csv)
