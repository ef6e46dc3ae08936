"""Publish a ChatRequest onto the request topic of its model and tier."""

from __future__ import annotations

from aiokafka.structs import RecordMetadata

from tokenbus.schemas import ChatRequest
from tokenbus.topics import RecordSender


class UnknownRoute(ValueError):
    """The request names a model or tier this bus does not serve."""


class RequestPublisher:
    def __init__(self, sender: RecordSender) -> None:
        self.sender = sender
        self._catalog = sender.catalog

    def topic_for(self, request: ChatRequest) -> str:
        settings = self._catalog.settings
        if request.model not in settings.models:
            raise UnknownRoute(f"model {request.model!r} is not served here")
        if request.tier not in settings.tiers:
            raise UnknownRoute(f"tier {request.tier!r} is not one of {settings.tiers}")
        return self._catalog.requests(request.model, request.tier)

    async def publish(self, request: ChatRequest, topic: str | None = None) -> RecordMetadata:
        """Publish and wait for the broker's ack; returns where the request landed. Requests are
        keyed by conversation (or request id), so a conversation's turns share a partition."""
        return await self.sender.send_and_wait(topic or self.topic_for(request), request, request.partition_key)
