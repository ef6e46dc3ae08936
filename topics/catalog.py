"""Every topic tokenbus uses, named from the prefix, the models and the tiers."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenbus.topics.settings import BusSettings

_UNSAFE_TOPIC_CHARS = re.compile(r"[^a-zA-Z0-9_-]")


def topic_safe(name: str) -> str:
    """Kafka topic names allow ``[a-zA-Z0-9._-]``; dots are our separators, so fold everything else."""
    return _UNSAFE_TOPIC_CHARS.sub("_", name)


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int


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
        s = self.settings
        specs = [
            TopicSpec(self.ingress, s.request_partitions),
            TopicSpec(self.tokens, s.token_partitions),
            TopicSpec(self.control, s.service_partitions),
            TopicSpec(self.completions, s.service_partitions),
            TopicSpec(self.moderation, s.service_partitions),
            TopicSpec(self.dlq, s.service_partitions),
        ]
        for model in s.models:
            specs += [TopicSpec(t, s.request_partitions) for t in self.model_request_topics(model)]
        return specs
