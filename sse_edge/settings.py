"""Settings of one SSE edge process."""

from __future__ import annotations

import re
import socket
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tokenbus.moderation import ModerationSettings
from tokenbus.stores.transcripts import TranscriptSettings
from tokenbus.topics import BusSettings
from tokenbus.topics.collector import GC_THRESHOLD
from tokenbus.topics.event_loops import EventLoop
from tokenbus.topics.settings import csv_items


def parse_pairs(value: object) -> object:
    """``interactive:64,standard:256`` or ``big-model:small-model`` as a dict (pydantic makes the
    values what the field says)."""
    if isinstance(value, str):
        pairs = (item.split(":", 1) for item in csv_items(value))
        return {name.strip(): target.strip() for name, target in pairs}
    return value


def parse_aliases(value: object) -> object:
    """``gpt-4.1=tokenbus-sim,gpt-4o-mini=tokenbus-sim`` as a dict."""
    if isinstance(value, str):
        pairs = (item.split("=", 1) for item in csv_items(value))
        return {alias.strip(): model.strip() for alias, model in pairs}
    return value


def parse_partitions(value: object) -> object:
    """``0,3`` or ``0-7`` (or both, ``0-3,8``) as a list of partition numbers."""
    if not isinstance(value, str):
        return value
    numbers: list[int] = []
    for part in csv_items(value):
        first, dash, last = part.partition("-")
        numbers += range(int(first), int(last) + 1) if dash else [int(first)]
    return numbers


class EdgeSettings(BaseSettings):
    """``TOKENBUS_EDGE_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_EDGE_", extra="ignore")

    bus: BusSettings = Field(default_factory=BusSettings)
    transcripts: TranscriptSettings = Field(default_factory=TranscriptSettings)
    moderation: ModerationSettings = Field(default_factory=ModerationSettings)
    # How a prompt is moderated on its way to `requests.<model>.<tier>`. `inline`: here, with the
    # policy of `moderation`, before publishing (no extra hop); `ingress`: by the moderation
    # processor, through `requests.ingress` (one more hop: a classifier too heavy for the edge
    # scales there); `direct`: not at all, for a deployment that runs no moderation.
    route: Literal["inline", "ingress", "direct"] = "inline"
    host: str = "127.0.0.1"
    port: int = 8700
    # uvicorn's HTTP/1.1 implementation: `auto` takes httptools where it is installed, else h11.
    http: Literal["auto", "h11", "httptools"] = "auto"
    loop: EventLoop = "auto"  # topics/event_loops.py
    gc_threshold: int = GC_THRESHOLD  # topics/collector.py
    # The partitions of `tokens` this process owns (`0,3` or `0-7`); each edge process needs its own.
    reply_partitions: Annotated[list[int], NoDecode] = [0]
    # For identical replicas (a Kubernetes StatefulSet): each takes this many reply partitions
    # from its ordinal, the number its host name ends with (`edge-2` with 4: partitions 8-11),
    # instead of reply_partitions. 0: reply_partitions as set.
    reply_partitions_per_ordinal: int = 0
    # New requests move to the next owned reply partition once the current one has been written
    # this many seconds (0: never); see topics/replies.py for why a broker without retention needs it.
    reply_rotate_s: float = 15.0
    # ... and sooner, once this many streams were opened on the current one (0: by time only), so
    # that a burst of streams does not pile into one partition's log.
    reply_rotate_streams: int = 1000
    redis_url: str = "redis://127.0.0.1:6379/0"
    # redis_url is a node of a Redis Cluster (the client finds the others and each key's shard).
    redis_cluster: bool = False
    redis_prefix: str = "tokenbus:"
    # When Redis is unreachable: `local` keeps rate limiting per process; `closed` refuses requests.
    redis_failure_mode: Literal["local", "closed"] = "local"
    key_cache_ttl_s: float = 5.0
    stream_ttl_s: int = 86_400  # how long streams stay resumable and idempotency keys bind
    disconnect_grace_s: float = 5.0  # a dropped client has this long to resume before its generation is cancelled
    stream_idle_timeout_s: float = 60.0
    # The billing processor's web address (its /usage page serves GET /v1/usage).
    usage_url: str = "http://127.0.0.1:8702"
    broker_check_s: float = 1.0  # how often the edge asks whether the broker answers
    broker_grace_s: float = 5.0  # open streams end with an error once the broker is away this long
    heartbeat_s: float = 15.0
    # On SIGTERM the edge stops accepting and gives open streams this long to finish; the rest
    # end with an `edge_stopping` error event, to be resumed on another edge.
    shutdown_grace_s: float = 10.0
    max_body_bytes: int = 1_000_000
    body_timeout_s: float = 30.0  # the whole request body must arrive within this
    max_messages: int = 256
    max_prompt_chars: int = 200_000
    max_output_tokens: int = 4096
    # Choices one response may have: OpenAI's `n` times a text completion's prompts (OpenAI's own cap
    # on `n` is 128). Each is a request on the bus, admitted as one with the response.
    max_choices: int = Field(default=128, ge=1)
    # Consumer lag per tier (requests waiting or running) above which new requests get 503;
    # leave room for what the consumers run at once. Unlisted tiers are unbounded.
    max_queue_depth: Annotated[dict[str, int], NoDecode] = {"interactive": 512, "standard": 2048, "batch": 8192}
    # Graceful degradation. Per model, the model that answers instead of a 503 when its queue for
    # the request's tier is full (`big-model:small-model`; one step, never a chain; a key may
    # forbid it). Per tier, the share of its max_queue_depth past which requests offering tools
    # are refused (`batch:0.5`): tool definitions make long prompts, and they go first.
    fallback: Annotated[dict[str, str], NoDecode] = {}
    # Other names a served model answers to (`gpt-4.1=tokenbus-sim,gpt-4o-mini=tokenbus-sim`; `=`
    # since model names may hold `:`), for clients that name OpenAI's models: a request naming one
    # is served by that model, as if it had named it (its answer names the model that served it,
    # as OpenAI's name the snapshot that answered), and `GET /v1/models` lists it.
    model_aliases: Annotated[dict[str, str], NoDecode] = {}
    shed_tools_at: Annotated[dict[str, float], NoDecode] = {}
    # Context windows in tokens per model (`model:tokens`): a prompt that cannot fit with its
    # max_tokens gets 400 context_length_exceeded, and server-side history fills the window. A
    # model without one: no check, and default_context_window for history.
    context_windows: Annotated[dict[str, int], NoDecode] = {}
    default_context_window: int = 8192
    # Per model, a tokenizer.json to count tokens with (`model:/path/tokenizer.json`); else estimated.
    tokenizers: Annotated[dict[str, str], NoDecode] = {}
    # Server-side history: the last turns of each conversation kept in Redis (rebuilt from the
    # transcript store when missing), for how long, and how long a request waits for its
    # conversation's previous turn to be stored.
    history_turns: int = 64
    history_ttl_s: int = 86_400
    history_wait_s: float = 5.0
    # Per model, the model that summarizes the turns its history leaves out (`model:summarizer`;
    # none: turns are just left out), and how long a summary may be.
    history_summaries: Annotated[dict[str, str], NoDecode] = {}
    history_summary_max_tokens: int = 256
    # OpenAI's Files and Batch APIs. An uploaded file's largest size (kept in Redis), how long
    # files and batches are kept, a batch's most requests (OpenAI's: 200 MB, 30 days, 50,000),
    # how long an upload may take, and the tier a batch's requests run at (unset: the lowest).
    max_file_bytes: int = Field(default=100_000_000, ge=1)
    file_ttl_s: int = 30 * 86_400
    file_body_timeout_s: float = 300.0
    max_batch_requests: int = Field(default=50_000, ge=1)
    batch_tier: str | None = None
    # OpenAI's Responses API: how long a stored response (``store``, the default) is kept, for
    # retrieval and for turns that continue it (OpenAI's: 30 days); a chat completion asked with
    # ``store: true`` too. A chain keeps its newest ``history_turns`` turns. ``store_responses``
    # false: nothing of a turn is kept at the edge (every request is served as ``store: false``; a
    # background one, which must be stored, is refused), for deployments that may not hold prompts.
    response_ttl_s: int = Field(default=30 * 86_400, ge=1)
    store_responses: bool = True
    # A conversation object (the Conversations API) is kept this long after it was last written
    # (made, added to, its metadata set): one in use does not expire. ``store_responses`` false
    # serves none.
    conversation_ttl_s: int = Field(default=30 * 86_400, ge=1)
    # The edge reading a stored response holds it this long unless it claims it again (each third
    # of it, as it reads): an edge that dies leaves it to the next edge asked after this long.
    reader_lease_s: float = Field(default=10.0, ge=0.3)

    _split_partitions = field_validator("reply_partitions", mode="before")(parse_partitions)
    _aliases = field_validator("model_aliases", mode="before")(parse_aliases)
    _pairs = field_validator("max_queue_depth", "fallback", "shed_tools_at", "context_windows", "tokenizers",
                             "history_summaries", mode="before")(parse_pairs)

    @model_validator(mode="after")
    def _partitions_of_this_replica(self) -> EdgeSettings:
        block = self.reply_partitions_per_ordinal
        if block > 0:
            ordinal = re.search(r"-(\d+)$", socket.gethostname())
            if ordinal is None:
                raise ValueError("reply_partitions_per_ordinal needs a host name ending with -<ordinal>")
            first = int(ordinal.group(1)) * block
            self.reply_partitions = list(range(first, first + block))
        return self

    def served_model(self, name: str) -> str:
        """The model a request naming ``name`` is served by (``name`` itself, unless an alias)."""
        return self.model_aliases.get(name, name)

    @property
    def batch_requests_tier(self) -> str:
        return self.batch_tier or self.bus.tiers[-1]

    @model_validator(mode="after")
    def _batch_tier_is_a_tier(self) -> EdgeSettings:
        if self.batch_tier is not None and self.batch_tier not in self.bus.tiers:
            raise ValueError(f"batch_tier {self.batch_tier!r} must be one of TOKENBUS_TIERS {self.bus.tiers}")
        return self

    @model_validator(mode="after")
    def _fallbacks_are_served(self) -> EdgeSettings:
        served = set(self.bus.models)
        for model, fallback in self.fallback.items():
            if model == fallback or fallback not in served:
                raise ValueError(f"fallback {model}:{fallback} must name another model of TOKENBUS_MODELS")
        for alias, model in self.model_aliases.items():
            if alias in served or model not in served:
                raise ValueError(f"model alias {alias}={model} must name a model of TOKENBUS_MODELS by another name")
        for model, summarizer in self.history_summaries.items():
            if summarizer not in served:
                raise ValueError(f"history summaries {model}:{summarizer} must name a model of TOKENBUS_MODELS")
        return self
