"""Readers wait at a hole in a partition's offsets (topics/holes.py): on the embedded broker a
fetch can find a batch stored before an earlier one another producer is writing at that moment.

The records below are real aiokafka batches, built as a producer builds them, with the base
offsets a broker would give them; the last test writes through the real brokers."""

import asyncio
import gc
import logging
import struct
import weakref

import aiokafka.consumer.fetcher
import pytest
from aiokafka import TopicPartition
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords

from tokenbus.topics import TopicCatalog, holes, make_consumer, make_producer
from tokenbus.topics.holes import HOLE_PATIENCE_S, PartitionRecordsWaitingAtHoles

TP = TopicPartition("replies", 0)
READ_UNCOMMITTED = 0


def batch(base_offset: int, records: int) -> bytes:
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for i in range(records):
        builder.append(i, timestamp=None, key=None, value=b"%d" % (base_offset + i), headers=[])
    encoded = bytearray(builder.build())
    struct.pack_into(">q", encoded, 0, base_offset)  # the broker's offset for the batch
    return bytes(encoded)


def fetched(fetch_offset: int, *batches: bytes) -> PartitionRecordsWaitingAtHoles:
    """The records of one fetched partition, as aiokafka's fetcher builds them."""
    return PartitionRecordsWaitingAtHoles(TP, MemoryRecords(b"".join(batches)), [], fetch_offset,
                                          None, None, False, READ_UNCOMMITTED)


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(holes.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(holes, "_first_seen", {})
    return now


def test_contiguous_batches_are_read_whole(clock):
    records = fetched(0, batch(0, 5), batch(5, 3))
    assert [r.offset for r in records] == list(range(8))
    assert records.next_fetch_offset == 8


def test_a_fetched_partition_is_freed_once_read_without_the_garbage_collector(clock):
    """A reader fetches every few milliseconds: each fetched partition must go when it is read, by
    reference counting, not sit in a cycle until a collection (topics/collector.py)."""
    records = fetched(0, batch(0, 5))
    gone = weakref.ref(records)
    gc.disable()
    try:
        assert [r.offset for r in records] == list(range(5))
        del records
        assert gone() is None
    finally:
        gc.enable()


def test_a_fetch_from_inside_a_batch_reads_on_from_there(clock):
    records = fetched(3, batch(0, 5), batch(5, 2))
    assert [r.offset for r in records] == [3, 4, 5, 6]


def test_the_records_end_at_a_hole_and_the_next_fetch_asks_from_it(clock):
    records = fetched(0, batch(0, 5), batch(10, 5))
    assert [r.offset for r in records] == [0, 1, 2, 3, 4]
    assert records.next_fetch_offset == 5  # the position aiokafka takes, and fetches from next

    before_the_batch_is_stored = fetched(5, batch(10, 5))
    assert list(before_the_batch_is_stored) == [] and before_the_batch_is_stored.next_fetch_offset == 5

    stored = fetched(5, batch(5, 5), batch(10, 5))
    assert [r.offset for r in stored] == list(range(5, 15))
    assert holes._first_seen == {}  # the hole is forgotten once filled


def test_a_hole_still_open_after_the_patience_is_passed_with_a_warning(clock, caplog):
    assert list(fetched(5, batch(10, 2))) == []
    clock[0] += HOLE_PATIENCE_S / 2
    assert list(fetched(5, batch(10, 2))) == []
    clock[0] += HOLE_PATIENCE_S / 2
    with caplog.at_level(logging.WARNING, logger=holes.__name__):
        assert [r.offset for r in fetched(5, batch(10, 2))] == [10, 11]
    assert "offsets 5 to 9 were not stored" in caplog.text
    assert holes._first_seen == {}


async def test_readers_miss_nothing_that_producers_write_at_once(each_bus, monkeypatch):
    """Four producers write into one partition at the same time while four readers follow it;
    each reader gets every record, in offset order. Without the wait at holes one of the readers
    on the embedded broker missed a batch or more in 11 of 14 runs of this (a race: the test can
    pass without the wait, never fail with it). The records are small: the mock Kafka cluster
    keeps only the last few megabytes of a partition."""
    if each_bus.broker == "kafka":  # what a Kafka deployment's readers run: aiokafka's own records
        monkeypatch.setattr(aiokafka.consumer.fetcher, "PartitionRecords", PartitionRecordsWaitingAtHoles.__base__)
    topic = TopicCatalog(each_bus).tokens
    tp = TopicPartition(topic, 0)
    producers = [make_producer(each_bus) for _ in range(4)]
    readers = [make_consumer(each_bus) for _ in range(4)]
    await asyncio.gather(*(c.start() for c in readers + producers))
    try:
        for reader in readers:
            reader.assign([tp])
            await reader.seek_to_beginning(tp)

        async def write(n: int, producer) -> list[int]:
            deliveries = []
            for i in range(3000):
                deliveries.append(await producer.send(topic, b"%d-%d " % (n, i) * 30, partition=0))
                if i % 5 == 0:
                    await asyncio.sleep(0.001)  # let the other producers in
            return [(await d).offset for d in deliveries]

        async def follow(reader) -> list[int]:
            offsets: list[int] = []
            while not writing.done() or await reader.position(tp) <= max(map(max, writing.result())):
                batches = await reader.getmany(tp, timeout_ms=100)
                offsets += [r.offset for r in batches.get(tp, [])]
            return offsets

        writing = asyncio.gather(*(write(n, p) for n, p in enumerate(producers)))
        async with asyncio.timeout(60):
            read = await asyncio.gather(*(follow(r) for r in readers))
        written = sorted(o for w in writing.result() for o in w)
        assert written == list(range(written[0], written[0] + len(written)))
        assert [len(offsets) for offsets in read] == [len(written)] * len(readers)
        assert all(offsets == written for offsets in read)
    finally:
        await asyncio.gather(*(c.stop() for c in readers + producers))
