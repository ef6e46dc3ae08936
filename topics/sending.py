"""Sending one record: encode it with the codec, key it, hand it to the producer.

Every service sends its records through a ``RecordSender`` (token events in bulk go through
``BatchingPublisher``, which encodes the same way), so how a record is framed and keyed is
decided here and nowhere else. A record sent while a span is current carries its trace context
in its headers (topics/tracing.py).
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from tokenbus.schemas import AvroCodec, Control, ControlAction, Record
from tokenbus.topics import tracing
from tokenbus.topics.catalog import TopicCatalog


class RecordSender:
    def __init__(self, producer: AIOKafkaProducer, codec: AvroCodec, catalog: TopicCatalog) -> None:
        self.producer = producer
        self.codec = codec
        self.catalog = catalog

    async def send(self, topic: str, record: Record, key: str,
                   partition: int | None = None) -> asyncio.Future[RecordMetadata]:
        """Queue ``record`` for ``topic``; the returned future resolves when the broker acknowledges it."""
        delivery: asyncio.Future[RecordMetadata] = await self.producer.send(
            topic, self.codec.encode(record), key=key.encode(), partition=partition,
            headers=tracing.record_headers() or None)
        return delivery

    async def send_and_wait(self, topic: str, record: Record, key: str,
                            partition: int | None = None) -> RecordMetadata:
        """Send ``record`` and wait for the broker's acknowledgement."""
        return await (await self.send(topic, record, key, partition))

    async def cancel(self, request_id: str, reason: str = "") -> None:
        """Ask whichever GPU consumer holds the request to stop it (within one engine step)."""
        await self.send_and_wait(self.catalog.control, Control(request_id, ControlAction.CANCEL, reason), request_id)
