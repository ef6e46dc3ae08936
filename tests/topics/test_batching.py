"""BatchingPublisher on both brokers: what one pass of the event loop publishes goes out in publish
order, records of one pass to one partition share a future that resolves once they are
acknowledged, and a record the broker refuses fails its own pass only; a keyed record's partition
is the one Kafka's default partitioner gives."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiokafka import TopicPartition
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2
from hypothesis import given
from hypothesis import strategies as st

from tokenbus.schemas import AvroCodec, TokenEvent
from tokenbus.topics import BatchingPublisher, TopicCatalog, make_consumer, make_producer
from tokenbus.topics.batching import kafka_partition, murmur2


async def read_back(bus, topic: str, partition: int, count: int) -> list[TokenEvent]:
    codec, consumer = AvroCodec(), make_consumer(bus)
    await consumer.start()
    tp = TopicPartition(topic, partition)
    consumer.assign([tp])
    await consumer.seek_to_beginning(tp)
    events: list[TokenEvent] = []
    try:
        for _ in range(100):
            for record in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                events.append(codec.decode(record.value, TokenEvent))
            if len(events) >= count:
                break
    finally:
        await consumer.stop()
    return events


@contextlib.asynccontextmanager
async def publishing(bus, **producer_options) -> AsyncIterator[BatchingPublisher]:
    producer = make_producer(bus, **producer_options)
    await producer.start()
    publisher = BatchingPublisher(producer, AvroCodec())
    try:
        yield publisher
    finally:
        await publisher.flush()
        await producer.stop()


async def test_passes_keep_publish_order_and_share_a_future_per_partition(each_bus):
    topic = TopicCatalog(each_bus).tokens
    async with publishing(each_bus) as publisher:
        futures = []
        for step in range(5):  # one pass of the loop per step, like an engine's steps
            same_pass = [publisher.publish(topic, 1, f"r{n}", TokenEvent(f"r{n}", step, f"{n}.{step}"))
                         for n in range(4)]
            other_partition = publisher.publish(topic, 2, "r9", TokenEvent("r9", step, f"9.{step}"))
            assert all(f is same_pass[0] for f in same_pass) and other_partition is not same_pass[0]
            futures += [same_pass[0], other_partition]
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*futures), 30)
        assert len(set(map(id, futures))) == 10
    one = await read_back(each_bus, topic, 1, 20)
    assert [e.text for e in one] == [f"{n}.{step}" for step in range(5) for n in range(4)]
    assert [e.text for e in await read_back(each_bus, topic, 2, 5)] == [f"9.{step}" for step in range(5)]


async def test_a_pass_bigger_than_a_batch_goes_out_as_several_in_order(bus):
    topic = TopicCatalog(bus).tokens
    async with publishing(bus, max_batch_size=16_384) as publisher:
        sent = [publisher.publish(topic, 5, "r", TokenEvent("r", seq, f"{seq}:" + "x" * 5_000)) for seq in range(10)]
        await asyncio.wait_for(sent[0], 30)
    assert [e.seq for e in await read_back(bus, topic, 5, 10)] == list(range(10))


async def test_handed_over_records_carry_their_offsets_across_the_kafka_batches_of_their_passes(bus):
    """Passes queued together and split over several Kafka batches: each record handed over goes with
    the offset the broker gave it (the express lane's readers take it as if fetched there)."""
    topic = TopicCatalog(bus).tokens
    handed: list[tuple[int, bytes]] = []
    async with publishing(bus, max_batch_size=16_384) as publisher:
        publisher._hand_over = lambda _topic, _partition, offset, key, _value: handed.append((offset, key))
        passes = []
        for step in range(3):  # each pass 10 x 5 KB: more than a batch, and passes share batches
            passes.append([publisher.publish(topic, 6, f"r{step}.{n}", TokenEvent("r", 10 * step + n, "x" * 5_000),
                                             hand_over=n % 3 == 0) for n in range(10)][0])
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*passes), 30)
    events = await read_back(bus, topic, 6, 30)
    assert [e.seq for e in events] == list(range(30))  # offset o holds seq o: the topic is new
    assert handed == [(10 * step + n, f"r{step}.{n}".encode()) for step in range(3) for n in (0, 3, 6, 9)]


async def test_a_record_bigger_than_the_batch_size_goes_out_in_a_batch_of_its_own_in_order(bus):
    """As Kafka's producers do: an empty batch takes one record whatever its size (the broker's
    message size limit is what bounds it)."""
    topic = TopicCatalog(bus).tokens
    async with publishing(bus, max_batch_size=16_384) as publisher:
        sent = [publisher.publish(topic, 7, key, TokenEvent(key, 0, text))
                for key, text in (("a", "small"), ("b", "x" * 40_000), ("c", "small again"))]
        await asyncio.wait_for(sent[0], 30)
    assert [e.request_id for e in await read_back(bus, topic, 7, 3)] == ["a", "b", "c"]


async def test_passes_that_queue_behind_a_batch_in_flight_go_out_together(bus):
    """aiokafka takes a partition's next batch once the one before has gone out, one produce
    request in flight at a time: passes published meanwhile (an engine's steps, a few ms apart)
    go out as one Kafka batch rather than a round trip each, in order, each pass's future resolved."""
    topic = TopicCatalog(bus).tokens
    async with publishing(bus) as publisher:
        batches = []
        send_batch = publisher._producer.send_batch

        async def counting(batch, *args, **kwargs):
            batches.append(batch.record_count())
            return await send_batch(batch, *args, **kwargs)

        publisher._producer.send_batch = counting
        futures = []
        for step in range(40):
            futures.append(publisher.publish(topic, 7, "r", TokenEvent("r", step, f"{step}")))
            await asyncio.sleep(0)  # the next pass
        await asyncio.wait_for(asyncio.gather(*futures), 30)
    assert sum(batches) == 40
    assert len(batches) < 40 / 2
    assert [e.seq for e in await read_back(bus, topic, 7, 40)] == list(range(40))


async def test_a_send_that_fails_fails_its_pass_only(bus):
    topic = TopicCatalog(bus).tokens
    async with publishing(bus) as publisher:
        nowhere = publisher.publish(topic, 999, "lost", TokenEvent("lost", 0, "no such partition"))
        elsewhere = publisher.publish(topic, 4, "small", TokenEvent("small", 0, "fits"))
        with pytest.raises(Exception) as failed:
            await asyncio.wait_for(nowhere, 30)
        assert not isinstance(failed.value, asyncio.TimeoutError)
        await asyncio.wait_for(elsewhere, 30)
    assert [e.text for e in await read_back(bus, topic, 4, 1)] == ["fits"]


async def test_a_cancelled_waiter_fails_no_one_else_and_loses_nothing_published(bus):
    """Cancelling a task cancels the future it awaits. Shielded (as the GPU consumer waits), the
    pass's other waiters still get their acknowledgement; unshielded, the pass's future is
    cancelled, yet its records go out and the publisher goes on with the next pass."""
    async def wait(delivery, shielded: bool) -> None:
        await (asyncio.shield(delivery) if shielded else delivery)

    topic = TopicCatalog(bus).tokens
    async with publishing(bus) as publisher:
        shared = publisher.publish(topic, 6, "a", TokenEvent("a", 0, "first"))
        leaving = asyncio.create_task(wait(shared, shielded=True))
        staying = asyncio.create_task(wait(publisher.publish(topic, 6, "b", TokenEvent("b", 0, "second")), True))
        await asyncio.sleep(0)
        leaving.cancel()
        await asyncio.wait_for(staying, 30)
        assert leaving.cancelled() and not shared.cancelled()

        unshielded = publisher.publish(topic, 6, "c", TokenEvent("c", 0, "third"))
        cancelled = asyncio.create_task(wait(unshielded, shielded=False))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert unshielded.cancelled()
        await asyncio.sleep(0.5)  # the cancelled pass is acknowledged meanwhile
        await asyncio.wait_for(publisher.publish(topic, 6, "d", TokenEvent("d", 0, "fourth")), 30)
    assert [e.text for e in await read_back(bus, topic, 6, 4)] == ["first", "second", "third", "fourth"]


@given(key=st.binary(max_size=80), count=st.integers(1, 64))
def test_murmur2_and_the_partition_are_kafkas_as_aiokafka_computes_them(key, count):
    """The same hash as aiokafka's own (the Java client's) for any key, every tail length after any
    number of words, so a completion published by partition lands where the producer's ``send``
    would put it."""
    assert murmur2(key) == aiokafka_murmur2(key)
    partitions = list(range(count))
    assert kafka_partition(key, partitions) == DefaultPartitioner()(key, partitions, partitions)
