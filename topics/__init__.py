"""The bus library: topic names and provisioning, aiokafka client settings,
and the two ways every service talks to the bus: sending a record
(``RecordSender``, ``BatchingPublisher`` for many at once, ``DeadLetterPublisher``) and
reading one request's token stream (``ReplyRouter`` live, ``replay`` from the log), or several
requests' as one (``ReplyGroup``: the choices of one response);
``TopicTail`` to follow a topic from now on; and
``tracing``, a turn's trace carried across the bus in record headers; ``event_loops`` and
``collector``, the event loop every service process runs on and how often it collects garbage;
``per_event_metrics``, the Prometheus series a service updates for every token event;
``holes``, how readers on the embedded broker wait for a batch numbered but not stored yet;
``make_codec``, how records are framed (with a schema registry or without)."""

from tokenbus.topics.batching import BatchingPublisher, acknowledged
from tokenbus.topics.catalog import TopicCatalog, TopicSpec, topic_safe
from tokenbus.topics.clients import (
    cancel_task,
    commit_as_member,
    committed_offsets,
    known_position,
    make_consumer,
    make_producer,
    profile,
    rewind_recreated,
    stop_reader,
    topic_partitions,
)
from tokenbus.topics.dead_letters import DeadLetterPublisher
from tokenbus.topics.framing import make_codec
from tokenbus.topics.pacing import FetchPacer
from tokenbus.topics.provision import delete_topics, ensure_topics
from tokenbus.topics.replay import record_at, replay
from tokenbus.topics.replies import ReplyRouter
from tokenbus.topics.reply_group import ReplyGroup
from tokenbus.topics.reply_stream import STREAM_IDLE, ReplyEvent, ReplyStream, ReplyStreamError
from tokenbus.topics.sending import RecordSender
from tokenbus.topics.settings import BusSettings
from tokenbus.topics.tail import TopicTail

__all__ = [
    "BatchingPublisher",
    "BusSettings",
    "DeadLetterPublisher",
    "FetchPacer",
    "RecordSender",
    "ReplyEvent",
    "ReplyGroup",
    "ReplyRouter",
    "ReplyStream",
    "ReplyStreamError",
    "STREAM_IDLE",
    "TopicCatalog",
    "TopicSpec",
    "TopicTail",
    "acknowledged",
    "cancel_task",
    "commit_as_member",
    "committed_offsets",
    "known_position",
    "delete_topics",
    "ensure_topics",
    "make_codec",
    "make_consumer",
    "make_producer",
    "profile",
    "record_at",
    "replay",
    "rewind_recreated",
    "stop_reader",
    "topic_partitions",
    "topic_safe",
]
