"""The client profiles of topics/clients.py, counted from the client side against the real
embedded broker: an idle consumer with the Kafka profile sends a couple of fetches a second
(the broker is asked to hold each up to 500 ms), the embedded profile polls, and a paced
embedded reader backs off once idle and returns to polling when records come."""

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka import TopicPartition

from tokenbus.topics import BusSettings, FetchPacer, TopicCatalog, committed_offsets, make_consumer, make_producer
from tokenbus.topics.clients import PROFILES
from tokenbus.topics.lane_watch import LaneWatch
from tokenbus.topics.starvation import StarvationWatch

WINDOW_S = 3.0


def counted_fetches(consumer, seen: Callable[[Any], Any] = lambda request: type(request).__name__) -> list[Any]:
    """What ``seen`` makes of each request ``consumer`` sends from now on (its name, unless told)."""
    sent: list[Any] = []
    send = consumer._client.send

    async def counting_send(node_id, request, *args, **kwargs):
        sent.append(seen(request))
        return await send(node_id, request, *args, **kwargs)

    consumer._client.send = counting_send
    return sent


async def fetches_while_idle(bus: BusSettings, paced: bool = False) -> float:
    """Fetch requests per second of a consumer reading one partition nobody writes to: with the
    profile's own wait, or ``paced`` (a FetchPacer, backed off once idle). Unpaced, no pacer at all:
    one would back off as soon as the start took longer than its idle_after_s, as on a busy machine."""
    consumer = make_consumer(bus)
    pacer = FetchPacer(bus) if paced else None
    sent = counted_fetches(consumer)
    await consumer.start()
    if pacer is not None:
        pacer.attach(consumer)
    try:
        tp = TopicPartition(TopicCatalog(bus).control, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        await consumer.getmany(timeout_ms=500)  # warmed up: metadata and the first fetch are done
        loop = asyncio.get_running_loop()
        if pacer is not None:  # idle long enough for the pacer to back off
            deadline = loop.time() + PROFILES[bus.broker].idle_after_s + 0.5
            while loop.time() < deadline:
                pacer.observed(sum(map(len, (await consumer.getmany(timeout_ms=100)).values())))
            assert pacer.idle
        before = sum(name.startswith("FetchRequest") for name in sent)
        deadline = loop.time() + WINDOW_S
        while loop.time() < deadline:
            read = sum(map(len, (await consumer.getmany(timeout_ms=100)).values()))
            if pacer is not None:
                pacer.observed(read)
        return (sum(name.startswith("FetchRequest") for name in sent) - before) / WINDOW_S
    finally:
        await consumer.stop()


def test_the_default_profile_is_kafka():
    assert BusSettings().broker == "kafka"
    assert PROFILES["kafka"].fetch_max_wait_ms >= 500 > PROFILES["embedded"].fetch_max_wait_ms


async def test_an_idle_consumer_with_kafka_settings_fetches_a_few_times_a_second(bus):
    kafka = await fetches_while_idle(bus.model_copy(update={"broker": "kafka"}))
    embedded = await fetches_while_idle(bus.model_copy(update={"broker": "embedded", "doorbell_url": None}))
    # The broker holds an idle fetch for its whole wait (Kafka's too): about 2 a second.
    print(f"idle fetches per second: kafka {kafka:.1f}, embedded {embedded:.1f}")
    assert 0 < kafka <= 5, kafka
    assert embedded > 10 * kafka, (embedded, kafka)  # the embedded profile buys latency with polling


async def test_an_idle_paced_reader_backs_off_and_a_record_wakes_it(bus):
    """Without a doorbell (tests/topics/test_doorbell.py has the reader that has one)."""
    embedded = bus.model_copy(update={"broker": "embedded", "doorbell_url": None})
    polling = await fetches_while_idle(embedded)
    paced = await fetches_while_idle(embedded, paced=True)
    print(f"idle fetches per second on the embedded broker: polling {polling:.1f}, paced {paced:.1f}")
    # At the idle wait the broker holds each fetch for all of it: ~10 a second, against ~200 polling
    # (~20 on a machine ten times slower than usual, where a paced reader fetched ~2 a second).
    assert paced <= 1000 / PROFILES["embedded"].idle_fetch_max_wait_ms * 2.5, (paced, polling)
    assert 4 * paced < polling, (paced, polling)

    consumer = make_consumer(embedded)
    await consumer.start()
    pacer = FetchPacer(embedded)
    pacer.attach(consumer)
    producer = make_producer(embedded)
    await producer.start()
    try:
        tp = TopicPartition(TopicCatalog(embedded).control, 1)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PROFILES["embedded"].idle_after_s + 0.5
        while loop.time() < deadline:
            pacer.observed(sum(map(len, (await consumer.getmany(timeout_ms=100)).values())))
        assert pacer.idle and consumer._fetcher._fetch_max_wait_ms == PROFILES["embedded"].idle_fetch_max_wait_ms
        await producer.send_and_wait(tp.topic, b"wake up", partition=1)
        got = 0
        while not got:
            got = sum(map(len, (await consumer.getmany(timeout_ms=1000)).values()))
            pacer.observed(got)
        assert not pacer.idle and consumer._fetcher._fetch_max_wait_ms == PROFILES["embedded"].fetch_max_wait_ms
    finally:
        await producer.stop()
        await consumer.stop()


@pytest.mark.parametrize("broker", ["embedded", "kafka"])
async def test_a_reader_serving_few_requests_asks_for_the_light_wait(bus, broker):
    """On the embedded broker, which holds a fetch for its whole wait, a request-path reader with
    few requests in flight fetches with the profile's light wait (the cores are not busy then, and
    each hop's record waits half the wait for a fetch), and with the busy one once it serves more:
    read from the fetch requests it sends. Kafka answers when a record arrives: one wait there."""
    settings = bus.model_copy(update={"broker": broker, "doorbell_url": None})
    tuned = PROFILES[broker]
    consumer = make_consumer(settings)
    sent = counted_fetches(consumer, lambda request: getattr(request, "_max_wait_ms", None))  # a FetchRequest's wait
    await consumer.start()
    pacer = FetchPacer(settings)
    pacer.attach(consumer)
    try:
        tp = TopicPartition(TopicCatalog(settings).control, 2)
        consumer.assign([tp])
        consumer.seek(tp, 0)

        async def waits_asked_serving(in_flight: int) -> set[int]:
            pacer.serving(in_flight)
            await consumer.getmany(timeout_ms=700)  # the fetch in flight ends; later ones have the new wait
            sent.clear()
            await consumer.getmany(timeout_ms=700)
            return set(sent) - {None}

        light = await waits_asked_serving(1)
        busy = await waits_asked_serving(pacer.LIGHT_IN_FLIGHT + 1)
    finally:
        await consumer.stop()
    if broker == "embedded":
        assert light == {tuned.light_fetch_max_wait_ms} and busy == {tuned.fetch_max_wait_ms}
        assert tuned.light_fetch_max_wait_ms < tuned.fetch_max_wait_ms
    else:
        assert light == busy == {tuned.fetch_max_wait_ms}


async def test_a_reader_the_broker_starves_raises_its_wait_until_records_come(bus):
    """The embedded broker lists every record batch of a partition on each fetch and answers nothing
    when that outlasts the fetch wait: a long-lived partition stops delivering to a short-wait
    reader (what stalled a 10-minute soak for half a minute). The paced reader notices that it
    stays behind the log end and raises its wait."""
    embedded = bus.model_copy(update={"broker": "embedded", "doorbell_url": None})
    tp = TopicPartition(TopicCatalog(embedded).control, 2)
    batches = 0

    async def fill_to(count: int) -> None:
        nonlocal batches
        producer = make_producer(embedded)
        await producer.start()
        try:
            while batches < count:  # one record per batch: each send is acknowledged before the next
                await producer.send_and_wait(tp.topic, b"t" * 64, partition=tp.partition)
                batches += 1
        finally:
            await producer.stop()

    async def tail_reader(pacer: FetchPacer | None, seconds: float) -> tuple[int, object]:
        consumer = make_consumer(embedded, fetch_max_wait_ms=1)
        await consumer.start()
        if pacer is not None:
            pacer.attach(consumer)
        try:
            consumer.assign([tp])
            consumer.seek(tp, batches - 3)
            got, deadline = 0, asyncio.get_running_loop().time() + seconds
            while got < 3 and asyncio.get_running_loop().time() < deadline:
                read = sum(map(len, (await consumer.getmany(timeout_ms=200)).values()))
                got += read
                if pacer is not None:
                    pacer.observed(read)
            return got, consumer._fetcher._fetch_max_wait_ms
        finally:
            await consumer.stop()

    # A plain 1 ms reader starves at 4,000 batches here; a faster machine may need more (the
    # broker lists ~0.6 µs a batch where it is fast, so 16,000 outlast 1 ms anywhere).
    for count in (4_000, 8_000, 16_000):
        await fill_to(count)
        plain_got, _ = await tail_reader(None, 2.0)
        if not plain_got:
            break
    assert plain_got == 0, f"a plain 1 ms reader still got records from {batches} batches"
    pacer = FetchPacer(embedded, busy_wait_ms=1)
    got, wait_ms = await tail_reader(pacer, 30.0)
    assert got == 3
    assert wait_ms == pacer.fetch_wait_ms > 1


async def test_committed_offsets_reads_a_groups_offsets_in_one_request(each_bus):
    """What the edge's queue-depth monitor reads every few seconds: one request for all of a
    group's partitions (``consumer.committed`` sends one per partition); 0 where none is committed."""
    tps = [TopicPartition(TopicCatalog(each_bus).control, p) for p in range(3)]
    group = f"{each_bus.topic_prefix}committed"
    committer, reader = make_consumer(each_bus, group_id=group), make_consumer(each_bus, group_id=group)
    await committer.start()
    await reader.start()
    try:
        committer.assign(tps)
        await committer.commit({tps[0]: 5, tps[1]: 7})
        sent = counted_fetches(reader)
        assert await committed_offsets(reader, tps) == {tps[0]: 5, tps[1]: 7, tps[2]: 0}
        assert [name for name in sent if name.startswith("OffsetFetch")] == ["OffsetFetchRequest"]
        assert await reader.committed(tps[1]) == 7
    finally:
        await committer.stop()
        await reader.stop()


async def test_a_partition_the_reader_held_meanwhile_is_not_taken_for_starved(bus, monkeypatch):
    """A GPU consumer holds a full tier's partitions and lets them go a fetch later: one that read
    nothing between two checks because it was held is not one the broker starves, so its wait
    stays; one left unpaused and still at the same place a check later is."""
    embedded = bus.model_copy(update={"broker": "embedded", "doorbell_url": None})
    monkeypatch.setattr(StarvationWatch, "CHECK_S", 0.0)  # every read is checked
    tp = TopicPartition(TopicCatalog(embedded).control, 3)
    producer = make_producer(embedded)
    await producer.start()
    try:
        first = (await producer.send_and_wait(tp.topic, b"backlog", partition=tp.partition)).offset
        for _ in range(9):
            await producer.send_and_wait(tp.topic, b"backlog", partition=tp.partition)
    finally:
        await producer.stop()
    consumer = make_consumer(embedded)
    await consumer.start()
    try:
        consumer.assign([tp])
        consumer.seek(tp, first)
        read = sum(map(len, (await consumer.getmany(tp, timeout_ms=2000, max_records=2)).values()))
        assert read == 2 and consumer.highwater(tp) == first + 10  # behind its log end from now on
        pacer = FetchPacer(embedded, busy_wait_ms=5)
        pacer.attach(consumer)
        pacer.observed(read)  # the first check: behind, at first + 2
        pacer.hold({tp})
        pacer.hold(set())
        pacer.observed(0)  # at first + 2 still, but held meanwhile
        assert pacer.fetch_wait_ms == 5
        pacer.observed(0)  # unpaused all along since, and still there: starved
        assert pacer.fetch_wait_ms == 10
    finally:
        await consumer.stop()


@pytest.mark.parametrize("broker", ["embedded", "kafka"])
async def test_a_light_reader_fed_by_the_express_lane_backs_it_up_at_the_express_wait(bus, broker, monkeypatch):
    """A light reader whose records also come by the express lane fetches with the profile's
    express wait once the lane has brought them a while: its fetches only back the lane up. A lane
    copy that comes after the fetched one only lost a race, and one that came before it but was not
    taken was brought all the same; a fetched record whose copy never comes brings the light wait
    back, and load the busy one. Kafka long-polls: one wait there."""
    monkeypatch.setattr(LaneWatch, "TRUST_AFTER_S", 0.3)
    monkeypatch.setattr(LaneWatch, "GRACE_S", 0.1)
    settings = bus.model_copy(update={"broker": broker, "doorbell_url": None})
    tuned = PROFILES[broker]
    consumer = make_consumer(settings)
    await consumer.start()
    pacer = FetchPacer(settings, express=True)
    pacer.attach(consumer)
    topic = TopicCatalog(settings).control

    def wait_serving(in_flight: int) -> int:
        pacer.serving(in_flight)
        wait: int = consumer._fetcher._fetch_max_wait_ms  # what aiokafka asks for in its next fetch
        return wait

    try:
        unheard = wait_serving(1)  # the lane has brought nothing yet
        pacer.handed_over(topic, 0, 10)
        too_soon = wait_serving(1)
        await asyncio.sleep(0.35)
        pacer.handed_over(topic, 0, 11)
        fed = wait_serving(1)
        pacer.fetched_first(topic, 0, 12)  # the fetch won the race...
        await asyncio.sleep(0.05)
        pacer.handed_over(topic, 0, 12)  # ...and the lane's copy came after it
        await asyncio.sleep(0.1)
        raced = wait_serving(1)
        pacer.fetched_first(topic, 0, 13)  # no copy comes
        await asyncio.sleep(0.15)
        missed = wait_serving(1)
        pacer.handed_over(topic, 0, 14)
        await asyncio.sleep(0.35)
        pacer.handed_over(topic, 0, 15)
        again = wait_serving(1)
        pacer.handed_over(topic, 0, 16)  # the lane's copy came first, but the reader took the fetched one
        pacer.fetched_first(topic, 0, 16)
        await asyncio.sleep(0.15)
        taken_late = wait_serving(1)
        loaded = wait_serving(pacer.LIGHT_IN_FLIGHT + 1)
    finally:
        await consumer.stop()
    if broker == "embedded":
        light, express = tuned.light_fetch_max_wait_ms, tuned.express_fetch_max_wait_ms
        assert express > tuned.fetch_max_wait_ms > light
        assert (unheard, too_soon, fed, raced, missed, again, taken_late) == (
            light, light, express, express, light, express, express)
        assert loaded == tuned.fetch_max_wait_ms
    else:
        assert {unheard, too_soon, fed, raced, missed, again, taken_late, loaded} == {tuned.fetch_max_wait_ms}


def spells_ended(pacer: FetchPacer) -> list[float]:
    """When each of ``pacer``'s spells ends from now on (its background partitions put to rest)."""
    ended: list[float] = []
    rest = pacer._rest

    def noting_rest() -> None:
        if pacer._consumer is not None and not pacer._idle:
            ended.append(time.monotonic())
        rest()

    pacer._rest = noting_rest  # type: ignore[method-assign]
    return ended


@pytest.mark.parametrize("broker", ["embedded", "kafka"])
async def test_a_readers_background_topics_are_fetched_in_spells(bus, broker):
    """With the embedded profile a reader's background topics (the processors' completions) rest
    paused between short spells while its other topics are fetched at the busy wait: counted in the
    fetch requests it sends, the background partition is named in a small share of them, and every
    record written to it is still read; while it is quiet, a spell ends once a fetch has answered
    for it (the old fixed spell took three or four). Kafka's profile has no spells: every fetch
    names both."""
    settings = bus.model_copy(update={"broker": broker, "doorbell_url": None})
    catalog = TopicCatalog(settings)
    busy, background = TopicPartition(catalog.control, 1), TopicPartition(catalog.completions, 1)
    consumer = make_consumer(settings)
    named = counted_fetches(consumer, lambda request: {topic for topic, _ in request.topics}
                            if type(request).__name__ == "FetchRequest" else None)
    await consumer.start()
    pacer = FetchPacer(settings, background_topics=[catalog.completions])
    pacer.attach(consumer)
    producer = make_producer(settings.model_copy(update={"broker": "embedded"}))  # Kafka's wants an idempotent broker
    await producer.start()
    marker = f"spells-{broker}-{id(pacer)}".encode()
    read: dict[str, int] = {busy.topic: 0, background.topic: 0}
    try:
        consumer.assign([busy, background])
        for tp in (busy, background):
            consumer.seek(tp, 0)
        loop = asyncio.get_running_loop()

        async def read_for(seconds: float) -> None:
            deadline = loop.time() + seconds
            while loop.time() < deadline:
                batches = await consumer.getmany(timeout_ms=50)
                pacer.observed(sum(map(len, batches.values())))
                for tp, records in batches.items():
                    read[tp.topic] += sum(r.value == marker for r in records)

        await read_for(0.5)  # what the topics held before
        named.clear()
        for _ in range(20):
            for tp in (busy, background):
                await producer.send_and_wait(tp.topic, marker, partition=tp.partition)
            await read_for(0.05)
        deadline = loop.time() + 10
        while read[background.topic] < 20 and loop.time() < deadline:
            await read_for(0.1)
        # The background topic quiet, the busy one not: each spell names it in a fetch that answers
        # (and the one the fetcher sent meanwhile), then rests.
        named.clear()
        ended = spells_ended(pacer)
        for _ in range(20):
            await producer.send_and_wait(busy.topic, marker, partition=busy.partition)
            await read_for(0.05)
        quiet_fetches = sum(background.topic in topics for topics in named if topics is not None)
        quiet_spells = len(ended)
        while read[busy.topic] < 40 and loop.time() < deadline + 10:
            await read_for(0.1)
    finally:
        await producer.stop()
        await pacer.close()
        await consumer.stop()
    fetches = [topics for topics in named if topics is not None]
    with_busy = sum(busy.topic in topics for topics in fetches)
    with_background = sum(background.topic in topics for topics in fetches)
    print(f"fetches naming the busy topic {with_busy}, the background one {with_background}")
    print(f"quiet: {quiet_fetches} fetches naming the background topic in {quiet_spells} spells")
    assert read == {busy.topic: 40, background.topic: 20}
    if broker == "embedded":
        assert with_background <= with_busy / 2, (with_background, with_busy)
        assert quiet_spells >= 5 and quiet_fetches <= 3 * quiet_spells, (quiet_fetches, quiet_spells)
    else:
        assert with_background == with_busy > 0
