"""The topic catalog, its provisioning, and aiokafka client settings."""

from topics.catalog import TopicCatalog, TopicSpec, topic_safe
from topics.clients import make_consumer, make_producer, stop_reader
from topics.provision import delete_topics, ensure_topics
from topics.settings import BusSettings

__all__ = [
    "BusSettings",
    "TopicCatalog",
    "TopicSpec",
    "delete_topics",
    "ensure_topics",
    "make_consumer",
    "make_producer",
    "stop_reader",
    "topic_safe",
]
