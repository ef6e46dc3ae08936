"""Publish many records as few produce batches: everything published during one pass of the
event loop (for the GPU consumer: one engine step of every running sequence) goes out as one
record batch per partition, in publish order.

aiokafka's per-message ``send`` costs tens of microseconds of Python per record; appending to a
batch costs a few, which is what lets one consumer process keep up with a busy engine.

A record published with ``hand_over`` is also handed to its readers once acknowledged, where the
producer has an express lane (the embedded producer with a doorbell, topics/doorbell.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from aiokafka import AIOKafkaProducer

from tokenbus.schemas import AvroCodec, Record

log = logging.getLogger(__name__)

_Record = tuple[bytes | None, bytes]


class _Pass:
    """What one pass of the event loop published to one partition, and the future they share."""

    __slots__ = ("records", "handed_over", "delivered")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.records: list[_Record] = []
        self.handed_over: list[int] = []  # indexes of the records to hand over once acknowledged
        self.delivered: asyncio.Future[None] = loop.create_future()


class BatchingPublisher:
    def __init__(self, producer: AIOKafkaProducer, codec: AvroCodec) -> None:
        self._producer = producer
        self._codec = codec
        self._pending: dict[tuple[str, int], _Pass] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self._locks: dict[tuple[str, int], asyncio.Lock] = defaultdict(asyncio.Lock)
        self._hand_over = getattr(producer, "hand_over", None)  # the embedded producer's express lane

    def publish(self, topic: str, partition: int, key: str, record: Record, hand_over: bool = False) -> asyncio.Future[None]:
        """Queue one record; the future resolves once it is acknowledged. Records published to one
        partition in one pass share their future (one per record cost as much as the encoding), so
        a task that may be cancelled awaits it through ``asyncio.shield``: cancelling a task
        cancels the future it awaits, which would fail the others' wait too."""
        pending = self._pending.get((topic, partition))
        if pending is None:
            loop = asyncio.get_running_loop()
            if not self._pending:
                loop.call_soon(self._flush)
            pending = self._pending[(topic, partition)] = _Pass(loop)
        if hand_over and self._hand_over is not None:
            pending.handed_over.append(len(pending.records))
        pending.records.append((key.encode(), self._codec.encode(record)))
        return pending.delivered

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        loop = asyncio.get_running_loop()
        for (topic, partition), batch in pending.items():
            task = loop.create_task(self._send(topic, partition, batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, topic: str, partition: int, batch: _Pass) -> None:
        # The lock keeps one partition's batches in flush order (asyncio's lock is FIFO); it is
        # held while batches are handed to aiokafka, not while they are acknowledged.
        submitted: list[tuple[range, asyncio.Future[Any]]] = []  # the indexes of a Kafka batch's records, its delivery
        error: Exception | None = None
        records = batch.records
        first = 0
        async with self._locks[(topic, partition)]:
            while records:
                kafka_batch = self._producer.create_batch()
                taken = 0
                for key, value in records:
                    if kafka_batch.append(key=key, value=value, timestamp=None) is None:
                        break
                    taken += 1
                if taken == 0:
                    error = ValueError(f"a record of {len(records[0][1])} bytes exceeds a batch")
                    break
                records = records[taken:]
                try:
                    submitted.append((range(first, first + taken),
                                      await self._producer.send_batch(kafka_batch, topic, partition=partition)))
                except Exception as exc:
                    error = exc
                    break
                first += taken
        for indexes, delivery in submitted:
            try:
                metadata = await delivery
            except Exception as exc:
                error = error or exc
            else:
                if batch.handed_over:
                    self._hand_over_acknowledged(topic, partition, batch, indexes, metadata.offset)
        if error is not None:
            log.warning("batch of %d records to %s-%s failed: %s", len(batch.records), topic, partition, error)
        if batch.delivered.done():  # cancelled by a task that awaited it unshielded; nobody waits
            return
        if error is not None:
            batch.delivered.set_exception(error)
        else:
            batch.delivered.set_result(None)

    def _hand_over_acknowledged(self, topic: str, partition: int, batch: _Pass, indexes: range, base_offset: int) -> None:
        """Hand over those of ``batch``'s records to hand over that went in the Kafka batch of
        ``indexes``, which the broker wrote from ``base_offset`` on."""
        assert self._hand_over is not None
        for index in batch.handed_over:
            if index in indexes:
                self._hand_over(topic, partition, base_offset + index - indexes.start, batch.records[index][1])

    async def flush(self) -> None:
        """Wait until everything published so far is acknowledged."""
        if self._pending:
            self._flush()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
