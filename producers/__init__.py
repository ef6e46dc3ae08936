"""Publishing requests to the bus and reading their token streams back."""

from producers.batching import BatchingPublisher
from producers.client import TokenbusClient, new_request_id
from producers.dead_letters import DeadLetterPublisher
from producers.publisher import RequestPublisher, UnknownRoute
from producers.replay import replay
from producers.replies import ReplyEvent, ReplyRouter, ReplyStream, ReplyStreamError

__all__ = [
    "BatchingPublisher",
    "DeadLetterPublisher",
    "ReplyEvent",
    "ReplyRouter",
    "ReplyStream",
    "ReplyStreamError",
    "RequestPublisher",
    "TokenbusClient",
    "UnknownRoute",
    "new_request_id",
    "replay",
]
