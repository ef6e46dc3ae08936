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
        delivery, _ = await self._send(topic, record, key, partition)
        return delivery

    async def send_and_wait(self, topic: str, record: Record, key: str,
                            partition: int | None = None, hand_over: bool = False) -> RecordMetadata:
        """Send ``record`` and wait for the broker's acknowledgement. With ``hand_over``, then hand
        it to its readers on the express lane, where the producer has one (topics/doorbell.py); not
        a record that carries a trace context, which only the fetched record's headers bring."""
        delivery, (value, headers) = await self._send(topic, record, key, partition)
        landed = await delivery
        lane = getattr(self.producer, "hand_over", None) if hand_over and not headers else None
        if lane is not None:
            lane(topic, landed.partition, landed.offset, key.encode(), value)
        return landed

    async def _send(self, topic: str, record: Record, key: str, partition: int | None,
                    ) -> tuple[asyncio.Future[RecordMetadata], tuple[bytes, list[tuple[str, bytes]]]]:
        value, headers = self.codec.encode(record), tracing.record_headers()
        delivery: asyncio.Future[RecordMetadata] = await self.producer.send(
            topic, value, key=key.encode(), partition=partition, headers=headers or None)
        return delivery, (value, headers)

    async def cancel(self, request_id: str, reason: str = "") -> None:
        """Ask whichever GPU consumer holds the request to stop it (within one engine step); a
        group's id (``group_cancel_id``) asks it of every request of the group, one record for all."""
        await self.send_and_wait(self.catalog.control, Control(request_id, ControlAction.CANCEL, reason), request_id)
