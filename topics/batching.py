"""Publish many records as few produce batches: everything published during one pass of the
event loop (for the GPU consumer: one engine step of every running sequence) goes out as one
record batch per partition, in publish order; passes that queued while the partition's previous
batch was on its way go out together.

aiokafka's per-message ``send`` costs tens of microseconds of Python per record; appending to a
batch costs a few, which is what lets one consumer process keep up with a busy engine.

A record published with ``hand_over`` is also handed to its readers once acknowledged, where the
producer has an express lane (the embedded producer with a doorbell, topics/doorbell.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from collections import defaultdict
from typing import Any

from aiokafka import AIOKafkaProducer

from tokenbus.schemas import AvroCodec, Record

log = logging.getLogger(__name__)

Headers = list[tuple[str, bytes]]
_Record = tuple[bytes | None, bytes, Headers | None]


_M = 0x5BD1E995  # murmur2's multiplier


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (``org.apache.kafka.common.utils.Utils.murmur2``), unsigned, as aiokafka's
    ``murmur2`` gives it, in half its time: the whole words unpacked at once and fewer masks. Every
    completion's key is hashed, so a turnover of a wave of sequences hashes hundreds."""
    length = len(data)
    h = 0x9747B28C ^ length
    words = length >> 2
    for k in struct.unpack_from(f"<{words}I", data):
        k = (k * _M) & 0xFFFFFFFF
        k = ((k ^ (k >> 24)) * _M) & 0xFFFFFFFF
        h = ((h * _M) & 0xFFFFFFFF) ^ k
    extra = length & 3
    if extra:
        tail = data[words * 4:]
        if extra == 3:
            h ^= tail[2] << 16
        if extra >= 2:
            h ^= tail[1] << 8
        h = ((h ^ tail[0]) * _M) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * _M) & 0xFFFFFFFF
    return h ^ (h >> 15)


def kafka_partition(key: bytes, partitions: list[int]) -> int:
    """Where Kafka's default partitioner (and aiokafka's) puts a record with ``key``: murmur2 of the
    key, made positive, modulo the number of partitions, in the order the producer lists them."""
    return partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]


class _Pass:
    """What one pass of the event loop published to one partition, and the future they share."""

    __slots__ = ("records", "handed_over", "delivered")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.records: list[_Record] = []
        self.handed_over: list[int] = []  # indexes of the records to hand over once acknowledged
        self.delivered: asyncio.Future[None] = loop.create_future()


_Span = tuple[_Pass, int, int]  # a pass, the first of its records in a Kafka batch, and how many
_Sent = tuple[list[_Span], asyncio.Future[Any]]  # a Kafka batch's spans, and its delivery


async def acknowledged(deliveries: list[asyncio.Future[Any]]) -> None:
    """Wait until each of ``deliveries`` is acknowledged, raising a failure as awaiting it would.
    The last one first: a partition's batches are acknowledged in the order they went out, so
    by then the others are nearly all done (4.5 of 129 pending on average at 51,200 tokens/s),
    and a request's task waits a few times rather than once per engine step (a wait costs a
    future and two callbacks). Through ``asyncio.shield``: a delivery is
    shared by the sequences of an engine step, and cancelling one waiting task must not cancel
    it for the others."""
    if deliveries:
        await asyncio.shield(deliveries[-1])
    for delivery in deliveries:
        if delivery.done():
            delivery.result()
        else:
            await asyncio.shield(delivery)


class BatchingPublisher:
    def __init__(self, producer: AIOKafkaProducer, codec: AvroCodec) -> None:
        self._producer = producer
        self._codec = codec
        self._pending: dict[tuple[str, int], _Pass] = {}
        # Passes flushed and not yet handed to aiokafka, per partition, and the one task that hands
        # them over, in order. aiokafka takes a partition's next batch only once the one before
        # has gone out in a produce request (one in flight per broker), so on a busy partition
        # passes queue here meanwhile, and the next Kafka batch takes all of them: at a batch a
        # pass, a hot partition fell behind its engine's steps by up to 2 s (BENCHMARKS.md §6).
        self._queued: dict[tuple[str, int], list[_Pass]] = defaultdict(list)
        self._senders: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._settling: set[asyncio.Task[None]] = set()
        self._hand_over = getattr(producer, "hand_over", None)  # the embedded producer's express lane

    def publish(self, topic: str, partition: int, key: str, record: Record, hand_over: bool = False,
                headers: Headers | None = None) -> asyncio.Future[None]:
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
        pending.records.append((key.encode(), self._codec.encode(record), headers or None))
        return pending.delivered

    def publish_keyed(self, topic: str, key: str, record: Record, headers: Headers | None = None,
                      ) -> asyncio.Future[None] | None:
        """``publish`` to the partition the producer's ``send`` would choose (Kafka's default
        partitioner on ``key``); None while the producer knows no partitions of ``topic``: ``send``
        it then, which fetches them. A record per request (a completion) costs a few microseconds
        here against ~60 through ``send`` and a task to wait for it."""
        cluster = self._producer.client.cluster
        partitions = cluster.partitions_for_topic(topic)
        if not partitions:
            return None
        # The producer's own partitioner is Kafka's default (make_producer sets none), and it lists
        # the partitions as ``send`` does.
        return self.publish(topic, kafka_partition(key.encode(), list(partitions)), key, record, headers=headers)

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        loop = asyncio.get_running_loop()
        for partition_key, batch in pending.items():
            self._queued[partition_key].append(batch)
            if partition_key not in self._senders:
                self._senders[partition_key] = loop.create_task(self._send_queued(*partition_key))

    async def _send_queued(self, topic: str, partition: int) -> None:
        """Hand the partition's queued passes to aiokafka, as few Kafka batches as they fit in, until
        none is left; their acknowledgements are awaited apart, so the next passes need not wait."""
        queue = self._queued[(topic, partition)]
        try:
            while queue:
                passes = queue[:]
                queue.clear()
                submitted, error = await self._submit(topic, partition, passes)
                settling = asyncio.get_running_loop().create_task(self._settle(topic, partition, passes, submitted, error))
                self._settling.add(settling)
                settling.add_done_callback(self._settling.discard)
        finally:
            del self._senders[(topic, partition)]
            if not queue:
                del self._queued[(topic, partition)]

    async def _submit(self, topic: str, partition: int, passes: list[_Pass]) -> tuple[list[_Sent], Exception | None]:
        """The passes' records in order as Kafka batches, each sent with the spans of passes it holds;
        and the error that stopped it, if one did."""
        submitted: list[_Sent] = []
        kafka_batch = self._producer.create_batch()
        spans: list[_Span] = []  # of passes in the Kafka batch being filled
        for batch in passes:
            records, start = batch.records, 0
            while start < len(records):
                end = start
                for key, value, headers in itertools.islice(records, start, None):
                    if kafka_batch.append(key=key, value=value, timestamp=None, headers=headers) is None:
                        break
                    end += 1
                if end > start:
                    spans.append((batch, start, end - start))
                    start = end
                if start < len(records):  # the Kafka batch is full: send it, go on in a new one
                    if not spans:
                        return submitted, ValueError(f"a record of {len(records[start][1])} bytes exceeds a batch")
                    error = await self._send_batch(kafka_batch, topic, partition, spans, submitted)
                    if error is not None:
                        return submitted, error
                    kafka_batch, spans = self._producer.create_batch(), []
        if spans:
            return submitted, await self._send_batch(kafka_batch, topic, partition, spans, submitted)
        return submitted, None

    async def _send_batch(self, kafka_batch: Any, topic: str, partition: int, spans: list[_Span],
                          submitted: list[_Sent]) -> Exception | None:
        try:
            delivery = await self._producer.send_batch(kafka_batch, topic, partition=partition)
        except Exception as exc:
            return exc
        submitted.append((spans, delivery))
        return None

    async def _settle(self, topic: str, partition: int, passes: list[_Pass], submitted: list[_Sent],
                      error: Exception | None) -> None:
        """Resolve each pass once every Kafka batch holding its records is acknowledged; a pass with
        a record in a batch that failed, or not sent, fails."""
        failed: dict[int, Exception] = {}
        sent: dict[int, int] = defaultdict(int)  # records of each pass in a Kafka batch
        for spans, delivery in submitted:
            for batch, _, count in spans:
                sent[id(batch)] += count
            try:
                metadata = await delivery
            except Exception as exc:
                failed.update((id(batch), exc) for batch, _, _ in spans)
                continue
            offset = metadata.offset  # the batch's first record's
            for batch, start, count in spans:
                for index in batch.handed_over:
                    if start <= index < start + count:
                        assert self._hand_over is not None
                        key, value, _ = batch.records[index]
                        self._hand_over(topic, partition, offset + index - start, key, value)
                offset += count
        for batch in passes:
            problem = failed.get(id(batch)) or (error if sent[id(batch)] < len(batch.records) else None)
            if problem is not None:
                log.warning("batch of %d records to %s-%s failed: %s", len(batch.records), topic, partition, problem)
            if batch.delivered.done():  # cancelled by a task that awaited it unshielded; nobody waits
                continue
            if problem is not None:
                batch.delivered.set_exception(problem)
            else:
                batch.delivered.set_result(None)

    async def flush(self) -> None:
        """Wait until everything published so far is acknowledged."""
        if self._pending:
            self._flush()
        while self._senders or self._settling:
            await asyncio.gather(*self._senders.values(), *self._settling, return_exceptions=True)
