"""The embedded broker's doorbell (topics/doorbell.py), with the real broker and real Redis: an
idle reader stops fetching; a producer's ring wakes it; a write nobody rings for still arrives
with the reader's periodic fetch; a reader paced per topic stops fetching a quiet topic while it
reads a busy one; rings are rate-limited per topic."""

import asyncio
import dataclasses
import uuid

import pytest
import redis.asyncio as redis
from aiokafka import TopicPartition

from tests.topics.test_client_profiles import counted_fetches
from tokenbus.topics import BusSettings, FetchPacer, TopicCatalog, ensure_topics, make_consumer, make_producer
from tokenbus.topics.catalog import TopicSpec
from tokenbus.topics.clients import PROFILES, EmbeddedProducer
from tokenbus.topics.doorbell import Doorbell, channel


def with_profile(monkeypatch, **changes) -> None:
    monkeypatch.setitem(PROFILES, "embedded", dataclasses.replace(PROFILES["embedded"], **changes))


class Reader:
    """A paced reader of one partition, as the services run theirs: read, tell the pacer, repeat."""

    def __init__(self, settings: BusSettings, *tps: TopicPartition, by_topic: bool = False) -> None:
        self.settings, self.tps, self.by_topic = settings, list(tps), by_topic
        self.records: list = []
        self.consumer = make_consumer(settings)
        self.pacer = FetchPacer(settings)
        self.sent = counted_fetches(self.consumer)

    async def __aenter__(self) -> "Reader":
        await self.consumer.start()
        self.pacer.attach(self.consumer)
        self.consumer.assign(self.tps)
        for tp in self.tps:
            self.consumer.seek(tp, 0)
        self.task = asyncio.create_task(self.read())
        return self

    async def read(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=100)
            self.records += [r for batch in batches.values() for r in batch]
            if self.by_topic:
                self.pacer.observed_by_topic(batches)
            else:
                self.pacer.observed(sum(map(len, batches.values())))

    async def until_paused(self, timeout: float = 20) -> None:
        """Until the pacer has paused the reader for idleness (failing, not hanging, if it never does)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.pacer.paused:
            assert loop.time() < deadline, "the reader never went idle"
            await asyncio.sleep(0.05)

    async def until_records(self, count: int, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.records) < count and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return len(self.records) >= count

    def fetches(self) -> int:
        return sum(name.startswith("FetchRequest") for name in self.sent)

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.pacer.close()
        await self.consumer.stop()


async def test_an_idle_reader_stops_fetching_and_a_ring_wakes_it(embedded, monkeypatch):
    with_profile(monkeypatch, idle_poll_s=3600.0)  # no periodic fetch: only a ring can wake it
    tp = TopicPartition(TopicCatalog(embedded).control, 0)
    silent = make_producer(embedded.model_copy(update={"doorbell_url": None}))
    ringing = make_producer(embedded)
    assert isinstance(ringing, EmbeddedProducer) and isinstance(silent, EmbeddedProducer)  # one rings, one not
    await silent.start()
    await ringing.start()
    try:
        async with Reader(embedded, tp) as reader:
            await reader.until_paused()
            before = reader.fetches()
            await asyncio.sleep(1.0)
            assert reader.fetches() == before  # paused: no fetch at all

            await silent.send_and_wait(tp.topic, b"unannounced", partition=0)
            assert not await reader.until_records(1, timeout=1.5)  # nobody rang: still asleep

            await ringing.send_and_wait(tp.topic, b"announced", partition=0)
            assert await reader.until_records(2, timeout=10)
            assert [r.value for r in reader.records] == [b"unannounced", b"announced"]
            assert not reader.pacer.paused
    finally:
        await silent.stop()
        await ringing.stop()


async def test_a_readers_own_pauses_and_the_pacers_do_not_undo_each_other(embedded, monkeypatch):
    """A GPU consumer holds a full tier's partitions paused (``FetchPacer.hold``) while its pacer
    pauses and resumes them all by traffic: a ring resumes every partition but the held one, and
    one let go while the reader is paused for idleness wakes it, as a ring would: what it held back
    was rung for long before, and no ring is coming for it."""
    with_profile(monkeypatch, idle_poll_s=3600.0)  # only rings wake the reader
    topic = TopicCatalog(embedded).control
    held, free = TopicPartition(topic, 0), TopicPartition(topic, 1)
    ringing = make_producer(embedded)
    await ringing.start()
    try:
        async with Reader(embedded, held, free) as reader:
            reader.pacer.hold({held})
            await reader.until_paused()
            await ringing.send_and_wait(topic, b"held back", partition=held.partition)
            await ringing.send_and_wait(topic, b"free", partition=free.partition)
            assert await reader.until_records(1, timeout=10)
            await asyncio.sleep(1.0)
            assert [r.value for r in reader.records] == [b"free"]
            assert held in reader.consumer.paused() and free not in reader.consumer.paused()

            await reader.until_paused()
            reader.pacer.hold(set())  # let go while asleep, with no ring to come
            assert await reader.until_records(2, timeout=5)
            assert sorted(r.value for r in reader.records) == [b"free", b"held back"]
            assert not reader.pacer.paused
    finally:
        await ringing.stop()


@pytest.mark.parametrize(("case", "partition"), [("ring lost", 1), ("redis away", 2)])
async def test_a_write_nobody_hears_arrives_with_the_periodic_fetch(embedded, monkeypatch, case, partition):
    """A lost ring costs latency, never a record: a producer that does not ring, or a doorbell
    whose Redis is away (its rings fail quietly and its reader cannot listen)."""
    with_profile(monkeypatch, idle_poll_s=0.5)
    if case == "ring lost":
        reading, writing = embedded, embedded.model_copy(update={"doorbell_url": None})
    else:
        reading = writing = embedded.model_copy(update={"doorbell_url": "redis://127.0.0.1:1/0"})
    tp = TopicPartition(TopicCatalog(embedded).control, partition)
    producer = make_producer(writing)
    await producer.start()
    try:
        async with Reader(reading, tp) as reader:
            await reader.until_paused()
            await producer.send_and_wait(tp.topic, b"unannounced", partition=partition)
            assert await reader.until_records(1, timeout=10)
    finally:
        await producer.stop()


async def two_fresh_topics(settings: BusSettings) -> tuple[TopicPartition, TopicPartition]:
    names = [f"{settings.topic_prefix}pacing-{kind}-{uuid.uuid4().hex[:6]}" for kind in ("busy", "quiet")]
    await ensure_topics(settings.bootstrap_servers, [TopicSpec(name, 1) for name in names])
    return TopicPartition(names[0], 0), TopicPartition(names[1], 0)


async def keep_writing(producer, tp: TopicPartition) -> None:
    while True:
        await producer.send_and_wait(tp.topic, b"busy", partition=tp.partition)
        await asyncio.sleep(0.2)


async def until_paused_alone(reader: Reader, quiet: TopicPartition, busy: TopicPartition) -> None:
    while quiet not in reader.consumer.paused():
        await asyncio.sleep(0.05)
    assert busy not in reader.consumer.paused() and not reader.pacer.paused  # the reader itself is busy


@pytest.mark.parametrize("woken_by", ["a ring", "the periodic fetch"])
async def test_a_quiet_topic_is_not_fetched_while_a_busy_one_is_read(embedded, monkeypatch, woken_by):
    """The embedded broker's cost of a fetch grows with the partitions it names: a reader paced per
    topic pauses the partitions of a topic it has heard nothing of, keeps reading the busy one,
    and reads the quiet one again when a writer rings for it or, if the ring is lost, with its
    periodic fetch."""
    with_profile(monkeypatch, idle_poll_s=3600.0 if woken_by == "a ring" else 0.5)
    busy, quiet = await two_fresh_topics(embedded)
    silent = make_producer(embedded.model_copy(update={"doorbell_url": None}))
    ringing = make_producer(embedded)
    await silent.start()
    await ringing.start()
    writing = asyncio.create_task(keep_writing(silent, busy))
    try:
        async with Reader(embedded, busy, quiet, by_topic=True) as reader:
            await asyncio.wait_for(until_paused_alone(reader, quiet, busy), timeout=20)
            await silent.send_and_wait(quiet.topic, b"unannounced", partition=0)
            heard = lambda: [r.value for r in reader.records if r.topic == quiet.topic]  # noqa: E731
            if woken_by == "a ring":
                await asyncio.sleep(1.5)
                assert heard() == []  # paused, and nobody rang
                await ringing.send_and_wait(quiet.topic, b"announced", partition=0)
                expected = [b"unannounced", b"announced"]
            else:
                expected = [b"unannounced"]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while heard() != expected and loop.time() < deadline:
                await asyncio.sleep(0.02)
            assert heard() == expected
    finally:
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
        await silent.stop()
        await ringing.stop()


class HoldingReader(Reader):
    """A reader that holds back partitions of its own (``held``), as a GPU consumer holds a full tier's."""

    held: frozenset[TopicPartition] = frozenset()

    async def read(self) -> None:
        while True:
            self.pacer.hold(set(self.held))
            batches = await self.consumer.getmany(timeout_ms=100)
            self.records += [r for batch in batches.values() for r in batch]
            self.pacer.observed_by_topic(batches)


async def test_a_partition_held_past_the_idle_time_is_read_at_once_when_let_go(embedded, monkeypatch):
    """A GPU consumer holds its full tier's partitions while its backlog waits, for longer than the
    pacer's idle time when slots free slowly (long generations in every slot), and its reader goes
    idle meanwhile (nothing to read but what it holds). Let go, what waits there is read at once:
    its writes rang long before, and waiting for the periodic fetch (here an hour; 10 s by
    default) would leave the free slots empty."""
    with_profile(monkeypatch, idle_after_s=0.3, idle_poll_s=3600.0)
    backlog, other = await two_fresh_topics(embedded)
    silent = make_producer(embedded.model_copy(update={"doorbell_url": None}))
    await silent.start()
    try:
        for _ in range(5):
            await silent.send_and_wait(backlog.topic, b"waiting", partition=0)
        reader = HoldingReader(embedded, backlog, other, by_topic=True)
        reader.held = frozenset({backlog})
        async with reader:
            await asyncio.sleep(1.2)  # four idle times with nothing read
            assert reader.records == [] and reader.pacer.paused  # (asleep: no fetches while it holds)
            reader.held = frozenset()
            assert await reader.until_records(5, timeout=5), "the backlog let go was not read"
    finally:
        await silent.stop()


async def test_rings_are_rate_limited_per_topic(embedded):
    client = redis.Redis.from_url(embedded.doorbell_url)
    heard: list[bytes] = []
    async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
        await pubsub.subscribe(channel(embedded.topic_prefix))
        doorbell = Doorbell(embedded.doorbell_url, embedded.topic_prefix, ring_every_s=60)
        for _ in range(5):
            doorbell.ring("a")
            doorbell.ring("b")
        await doorbell.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2
        while loop.time() < deadline and len(heard) < 3:
            message = await pubsub.get_message(timeout=0.2)
            if message:
                heard.append(message["data"])
    await client.aclose()
    assert sorted(heard) == [b"a", b"b"]
