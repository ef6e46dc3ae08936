"""Every topic tokenbus uses, named from the prefix, the models and the tiers."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenbus.topics.settings import BusSettings

_UNSAFE_TOPIC_CHARS = re.compile(r"[^a-zA-Z0-9_-]")


def topic_safe(name: str) -> str:
    """Kafka topic names allow ``[a-zA-Z0-9._-]``; dots are our separators, so fold everything else."""
    return _UNSAFE_TOPIC_CHARS.sub("_", name)


HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
# A rolled reply log is read by the one edge that made it: one partition is all it needs.
ROLLED_REPLY_LOG_PARTITIONS = 1


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic as provisioning creates it: on a Kafka cluster replicated (``replicas``) with the
    topic-level ``config`` (retention, min.insync.replicas); the embedded broker has one node and
    keeps everything until the topic is deleted."""

    name: str
    partitions: int
    replicas: int = 1
    config: dict[str, str] = field(default_factory=dict)


class TopicCatalog:
    def __init__(self, settings: BusSettings) -> None:
        self.settings = settings
        self.prefix = settings.topic_prefix

    def _name(self, *parts: str) -> str:
        return self.prefix + ".".join(parts)

    @property
    def ingress(self) -> str:
        return self._name("requests", "ingress")

    def requests(self, model: str, tier: str) -> str:
        return self._name("requests", topic_safe(model), topic_safe(tier))

    def model_request_topics(self, model: str) -> list[str]:
        """A model's request topics, highest tier first."""
        return [self.requests(model, tier) for tier in self.settings.tiers]

    @property
    def tokens(self) -> str:
        return self._name("tokens")

    def rolled_reply_log(self, owner: str, created_ms: int) -> str:
        """A reply router's log of one rotation on the embedded broker (topics/replies.py)."""
        return self.rolled_reply_logs_of(owner) + str(created_ms)

    def rolled_reply_logs_of(self, owner: str) -> str:
        """What the names of a reply router's rolled logs begin with."""
        return self._name("tokens", owner, "")

    def is_reply_log(self, name: str) -> bool:
        """``tokens`` or a rolled reply log: where token events are written."""
        return name == self.tokens or self.parse_rolled_reply_log(name) is not None

    def parse_rolled_reply_log(self, name: str) -> tuple[str, int] | None:
        """``(owner, created_ms)`` of a rolled reply log's name; None for any other topic."""
        owner, _, created = name.removeprefix(self.tokens + ".").partition(".")
        if not name.startswith(self.tokens + ".") or not owner or not created.isdigit():
            return None
        return owner, int(created)

    @property
    def control(self) -> str:
        return self._name("control")

    @property
    def completions(self) -> str:
        return self._name("completions")

    @property
    def moderation(self) -> str:
        return self._name("moderation")

    @property
    def cache_reports(self) -> str:
        """GPU consumers' reports of what their engines' prefix caches hold (CacheReport)."""
        return self._name("kvcache")

    @property
    def dlq(self) -> str:
        return self._name("dlq")

    def gpu_group(self, model: str) -> str:
        """The consumer group of a model's GPU consumers: its lag is the model's queue depth."""
        return self._name("gpu", topic_safe(model))

    def tier_of(self, topic: str, model: str) -> str | None:
        for tier in self.settings.tiers:
            if self.requests(model, tier) == topic:
                return tier
        return None

    def all_topics(self) -> list[TopicSpec]:
        """Every topic with its partitions and, for a Kafka cluster, replication and retention:
        token streams as long as streams are resumable, completions long enough to replay
        billing, decisions and dead letters long enough to audit, requests and cancels briefly."""
        s = self.settings

        def spec(name: str, partitions: int, retention_ms: int) -> TopicSpec:
            if s.broker == "embedded":  # one node, no retention
                return TopicSpec(name, partitions)
            config = {"retention.ms": str(retention_ms), "min.insync.replicas": str(min(s.min_insync_replicas,
                                                                                         s.replication_factor))}
            return TopicSpec(name, partitions, s.replication_factor, config)

        specs = [
            spec(self.ingress, s.request_partitions, DAY_MS),
            spec(self.tokens, s.token_partitions, s.token_retention_ms),
            spec(self.control, s.service_partitions, HOUR_MS),
            spec(self.completions, s.service_partitions, s.completion_retention_ms),
            spec(self.moderation, s.service_partitions, 30 * DAY_MS),
            spec(self.dlq, s.service_partitions, 30 * DAY_MS),
            # Read live only: a router learns a worker's cache from its next snapshot.
            spec(self.cache_reports, s.service_partitions, HOUR_MS),
        ]
        for model in s.models:
            specs += [spec(t, s.request_partitions, DAY_MS) for t in self.model_request_topics(model)]
        return specs
