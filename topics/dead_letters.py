"""Send a record that cannot be decoded or processed to ``dlq``, unchanged, with why in its headers."""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaProducer, ConsumerRecord

from tokenbus.topics.catalog import TopicCatalog

log = logging.getLogger(__name__)

HEADER_REASON = "tokenbus.dlq.reason"
HEADER_DETAIL = "tokenbus.dlq.detail"
HEADER_SOURCE = "tokenbus.dlq.source"  # topic/partition/offset of the original


class DeadLetterPublisher:
    def __init__(self, producer: AIOKafkaProducer, catalog: TopicCatalog) -> None:
        self._producer = producer
        self._topic = catalog.dlq

    async def send(self, record: ConsumerRecord, reason: str, detail: str = "") -> None:
        headers = [
            (HEADER_REASON, reason.encode()),
            (HEADER_DETAIL, detail[:1000].encode()),
            (HEADER_SOURCE, f"{record.topic}/{record.partition}/{record.offset}".encode()),
        ]
        log.warning("dead-lettering %s/%s/%s: %s", record.topic, record.partition, record.offset, reason)
        delivery = await self._producer.send(self._topic, record.value, key=record.key, headers=headers)
        await delivery
