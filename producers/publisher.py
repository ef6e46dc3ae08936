"""Publish a ChatRequest onto the request topic of its model and tier."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from schemas import AvroCodec, ChatRequest
from topics import TopicCatalog


class UnknownRoute(ValueError):
    """The request names a model or tier this bus does not serve."""


class RequestPublisher:
    def __init__(self, producer: AIOKafkaProducer, catalog: TopicCatalog, codec: AvroCodec) -> None:
        self._producer = producer
        self._catalog = catalog
        self._codec = codec

    def topic_for(self, request: ChatRequest) -> str:
        settings = self._catalog.settings
        if request.model not in settings.models:
            raise UnknownRoute(f"model {request.model!r} is not served here")
        if request.tier not in settings.tiers:
            raise UnknownRoute(f"tier {request.tier!r} is not one of {settings.tiers}")
        return self._catalog.requests(request.model, request.tier)

    async def publish(self, request: ChatRequest, topic: str | None = None) -> RecordMetadata:
        """Publish and wait for the broker's ack; returns where the request landed."""
        delivery = await self._producer.send(
            topic or self.topic_for(request),
            self._codec.encode(request),
            key=request.partition_key.encode(),
        )
        return await delivery
