"""Publish many records as few produce batches: everything published during one pass of the
event loop (for the GPU consumer: one engine step of every running sequence) goes out as one
record batch per partition, in publish order.

aiokafka's per-message ``send`` costs tens of microseconds of Python per record; appending to a
batch costs a few, which is what lets one consumer process keep up with a busy engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from aiokafka import AIOKafkaProducer

from tokenbus.schemas import AvroCodec, Record

log = logging.getLogger(__name__)

_Record = tuple[bytes | None, bytes, asyncio.Future[None]]


class BatchingPublisher:
    def __init__(self, producer: AIOKafkaProducer, codec: AvroCodec) -> None:
        self._producer = producer
        self._codec = codec
        self._pending: dict[tuple[str, int], list[_Record]] = defaultdict(list)
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[None]] = set()
        self._locks: dict[tuple[str, int], asyncio.Lock] = defaultdict(asyncio.Lock)

    def publish(self, topic: str, partition: int, key: str, record: Record) -> asyncio.Future[None]:
        """Queue one record; the future resolves once its batch is acknowledged."""
        loop = asyncio.get_running_loop()
        delivered: asyncio.Future[None] = loop.create_future()
        self._pending[(topic, partition)].append((key.encode(), self._codec.encode(record), delivered))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return delivered

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, defaultdict(list)
        for (topic, partition), records in pending.items():
            task = asyncio.get_running_loop().create_task(self._send(topic, partition, records))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, topic: str, partition: int, records: list[_Record]) -> None:
        # The lock keeps one partition's batches in flush order (asyncio's lock is FIFO); it is
        # held while batches are handed to aiokafka, not while they are acknowledged.
        submitted: list[tuple[asyncio.Future[Any] | None, list[_Record], Exception | None]] = []
        async with self._locks[(topic, partition)]:
            while records:
                batch = self._producer.create_batch()
                taken = 0
                for key, value, _ in records:
                    if batch.append(key=key, value=value, timestamp=None) is None:
                        break
                    taken += 1
                chunk, records = records[: max(taken, 1)], records[max(taken, 1):]
                if taken == 0:
                    submitted.append((None, chunk, ValueError(f"a record of {len(chunk[0][1])} bytes exceeds a batch")))
                    continue
                try:
                    submitted.append((await self._producer.send_batch(batch, topic, partition=partition), chunk, None))
                except Exception as exc:
                    submitted.append((None, chunk, exc))
        for delivery, chunk, error in submitted:
            if delivery is not None:
                try:
                    await delivery
                except Exception as exc:
                    error = exc
            if error is not None:
                log.warning("batch of %d records to %s-%s failed: %s", len(chunk), topic, partition, error)
            for *_, delivered in chunk:
                if delivered.done():
                    continue
                if error is None:
                    delivered.set_result(None)
                else:
                    delivered.set_exception(error)

    async def flush(self) -> None:
        """Wait until everything published so far is acknowledged."""
        if self._flush_scheduled:
            self._flush()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
