"""Rolled reply logs on the embedded broker (topics/replies.py, topics/rolled_logs.py): a rotating
router writes each rotation to a new topic and deletes it once done with, a reader of every
stream follows the logs as they come and go, and a late writer does not bring a deleted log back.
Embedded broker only: on Kafka, retention bounds the logs and routers rotate through partitions."""

import asyncio
import dataclasses
import time

from aiokafka import AIOKafkaProducer

from tests.waiting import wait_for
from tokenbus.schemas import AvroCodec, TokenEvent
from tokenbus.topics import BusSettings, ReplyRouter, TopicCatalog, make_producer, replies, rolled_logs
from tokenbus.topics import clients as bus_clients
from tokenbus.topics.provision import TopicAdmin
from tokenbus.topics.rolled_logs import RolledLogReader

codec = AvroCodec()


async def listed(bus: BusSettings) -> set[str]:
    admin = TopicAdmin(bus.bootstrap_servers)
    await admin.start()
    try:
        return set(await admin.names())
    finally:
        await admin.close()


def texts_into(got: list[str]):
    """A reader's ``on_record`` that keeps each token event's text in ``got``."""
    async def on_record(record) -> None:
        got.append(codec.decode(record.value, TokenEvent).text)
    return on_record


async def send(producer: AIOKafkaProducer, topic: str, request_id: str, seq: int, final: bool = False) -> None:
    event = TokenEvent(request_id, seq, f"{request_id}:{seq}", [seq], finish_reason="stop" if final else None)
    await producer.send_and_wait(topic, codec.encode(event), key=request_id.encode(), partition=0)


async def test_each_rotation_writes_a_new_log_and_a_log_is_deleted_once_its_streams_ended(bus, monkeypatch):
    monkeypatch.setattr(replies, "ROLLED_LOG_QUIET_S", 0.0)
    catalog = TopicCatalog(bus)
    router = ReplyRouter(bus, partitions=[0], rotate_every_s=0.3, roll_logs=True, keep_s=0.0)
    producer = make_producer(bus)
    await producer.start()
    await router.start()
    try:
        first = router.reply_topic
        assert catalog.parse_rolled_reply_log(first) is not None and router.reply_partition == 0
        early = router.open("early", router.reply_partition, first)
        await send(producer, first, "nobody", 0, final=True)  # a log written moves on after rotate_every_s
        await wait_for(lambda: router.reply_topic != first)
        late = router.open("late", router.reply_partition, router.reply_topic)
        await send(producer, router.reply_topic, "late", 0, final=True)
        assert [r.event.text async for r in late.events(idle_timeout=10)] == ["late:0"]
        await asyncio.sleep(1.5)  # rotations and deletion rounds go by: the open stream keeps its log
        assert first in await listed(bus)

        await send(producer, first, "early", 0)
        await send(producer, first, "early", 1, final=True)
        assert [r.event.text async for r in early.events(idle_timeout=10)] == ["early:0", "early:1"]
        deadline = time.monotonic() + 10
        while first in await listed(bus):
            assert time.monotonic() < deadline, "the ended log was not deleted"
            await asyncio.sleep(0.2)
        current = router.reply_topic
        await send(producer, current, "nobody", 1, final=True)
        await wait_for(lambda: router.reply_topic != current)
        assert router.reply_topic in await listed(bus)  # the current log stays
    finally:
        await router.stop()
        await producer.stop()


async def test_after_the_broker_returns_new_requests_write_to_fresh_logs(bus):
    """The embedded broker comes back empty, and a log a late writer wrote to again is created
    afresh over those writes once anything names it: the router moves new requests to logs it
    makes now, and keeps reading the streams still open on the old one."""
    router = ReplyRouter(bus, partitions=[0], rotate_every_s=3600, roll_logs=True, keep_s=600.0)
    producer = make_producer(bus)
    await producer.start()
    await router.start()
    try:
        before, lost_next = router.rolled_logs
        still_open = router.open("still-open", router.reply_partition, before)
        await router.broker_returned()
        assert router.reply_topic not in (before, lost_next)
        assert {before, lost_next} <= set(router.rolled_logs[:-2])  # retired: deleted once done with
        assert router.rolled_logs[-2:] == [router.reply_topic, router.rolled_logs[-1]]
        assert {router.reply_topic, router.rolled_logs[-1]} <= await listed(bus)

        fresh = router.open("fresh", router.reply_partition, router.reply_topic)
        await send(producer, router.reply_topic, "fresh", 0, final=True)
        await send(producer, before, "still-open", 0, final=True)
        assert [(r.event.text, r.offset) async for r in fresh.events(idle_timeout=10)] == [("fresh:0", 0)]
        assert [r.event.text async for r in still_open.events(idle_timeout=10)] == ["still-open:0"]
    finally:
        await router.stop()
        await producer.stop()


async def test_a_router_sweeps_its_recreated_logs_and_long_abandoned_ones(bus, monkeypatch):
    monkeypatch.setattr(replies, "SWEEP_EVERY_S", 0.0)
    catalog = TopicCatalog(bus)
    router = ReplyRouter(bus, partitions=[0], rotate_every_s=3600, roll_logs=True, keep_s=60.0)
    await router.start()
    owner = catalog.parse_rolled_reply_log(router.reply_topic)[0]
    now_ms = int(time.time() * 1000)
    recreated = catalog.rolled_reply_log(owner, now_ms - 1000)  # its own, deleted and written again late
    abandoned = catalog.rolled_reply_log("deadbeef", now_ms - 2 * 3600 * 1000)
    alive = catalog.rolled_reply_log("cafecafe", now_ms - 1000)  # another router's, in use
    admin = TopicAdmin(bus.bootstrap_servers)
    await admin.start()
    try:
        for name in (recreated, abandoned, alive):
            await admin.create(name, partitions=1)
        deadline = time.monotonic() + 10
        while {recreated, abandoned} & set(await admin.names()):
            assert time.monotonic() < deadline, "not swept"
            await asyncio.sleep(0.2)
        assert {alive, router.reply_topic} <= set(await admin.names())
    finally:
        await admin.close()
        await router.stop()


async def test_a_quiet_router_moves_to_fresh_logs_so_another_never_sweeps_the_one_it_uses(bus, monkeypatch):
    """Routers take each other's logs made long ago for abandoned; a quiet router stays on one log
    (it rotates by written seconds), so it moves to logs made now before its own look that old."""
    monkeypatch.setattr(replies, "SWEEP_EVERY_S", 0.0)
    monkeypatch.setattr(replies, "ABANDONED_AFTER_S", 4.0)
    monkeypatch.setattr(replies, "FRESH_LOGS_AFTER_S", 2.0)
    quiet = ReplyRouter(bus, partitions=[0], rotate_every_s=3600, roll_logs=True, keep_s=0.0)
    sweeper = ReplyRouter(bus, partitions=[1], rotate_every_s=3600, roll_logs=True, keep_s=0.0)
    await quiet.start()
    await sweeper.start()
    try:
        used = [quiet.reply_topic]
        deadline = time.monotonic() + 9
        while time.monotonic() < deadline:  # the sweeper looks every tick (1 s) meanwhile
            if quiet.reply_topic != used[-1]:
                used.append(quiet.reply_topic)
            assert quiet.reply_topic in await listed(bus)
            await asyncio.sleep(0.3)
        assert len(used) >= 3  # it moved on every 2 s or so, with nothing written
        assert used[0] not in await listed(bus)  # once done with: deleted (by its router or the sweeper)
    finally:
        await quiet.stop()
        await sweeper.stop()


async def test_a_producer_forgets_old_topics_so_a_deleted_log_stays_deleted(bus, monkeypatch):
    """The embedded broker creates a topic that a metadata request names, and aiokafka names every
    topic a producer ever wrote to: a plain producer brings a deleted log back, ours does not."""
    monkeypatch.setattr(bus_clients, "FORGET_TOPIC_AFTER_S", 0.2)
    catalog = TopicCatalog(bus)
    admin = TopicAdmin(bus.bootstrap_servers)
    await admin.start()
    plain = AIOKafkaProducer(bootstrap_servers=bus.bootstrap_servers)
    ours = make_producer(bus)
    await plain.start()
    await ours.start()
    try:
        logs = {}
        for name, producer in (("plain", plain), ("ours", ours)):
            logs[name] = catalog.rolled_reply_log(name, int(time.time() * 1000))
            await admin.create(logs[name], partitions=1)
            await send(producer, logs[name], "r", 0, final=True)
        await admin.delete(list(logs.values()))
        await asyncio.sleep(0.3)
        await send(ours, catalog.tokens, "other", 0)  # a write later: ours forgets what it no longer writes
        for producer in (plain, ours):
            await producer.client.force_metadata_update()
        names = set(await admin.names())
        assert logs["plain"] in names  # what a plain producer does
        assert logs["ours"] not in names
    finally:
        await plain.stop()
        await ours.stop()
        await admin.close()


async def test_a_reader_started_before_any_log_reads_the_first_one(bus, monkeypatch):
    """The processors may start before any edge made a log (aiokafka's getmany, with nothing
    assigned to a consumer of a group, waits for an assignment for ever)."""
    monkeypatch.setattr(rolled_logs, "DISCOVER_EVERY_S", 0.2)
    got: list[str] = []

    reader = RolledLogReader(bus, f"{bus.topic_prefix}moderation", texts_into(got))
    await reader.start()
    admin = TopicAdmin(bus.bootstrap_servers)
    await admin.start()
    producer = make_producer(bus)
    await producer.start()
    try:
        await asyncio.sleep(0.5)  # the reader found nothing, and looks again
        first = TopicCatalog(bus).rolled_reply_log("r1", int(time.time() * 1000))
        await admin.create(first, partitions=1)
        await send(producer, first, "a", 0, final=True)
        await wait_for(lambda: got == ["a:0"])
    finally:
        await reader.stop()
        await producer.stop()
        await admin.close()


async def test_a_record_cut_off_by_a_stop_is_read_again_by_the_next_reader(bus):
    """Output moderation hands each record of the logs to its job as it comes, with nothing to
    carry a record's handling past a stop (stream_processors/context.py, ``process_record``):
    what makes that safe is that the reader commits only the records it finished."""
    log = TopicCatalog(bus).rolled_reply_log("r1", int(time.time() * 1000))
    group = f"{bus.topic_prefix}cut-off"
    admin = TopicAdmin(bus.bootstrap_servers)
    await admin.start()
    await admin.create(log, partitions=1)
    producer = make_producer(bus)
    await producer.start()
    finished: list[str] = []
    stuck = asyncio.Event()

    async def handle(record) -> None:
        text = codec.decode(record.value, TokenEvent).text
        if text == "a:1":
            stuck.set()
            await asyncio.Event().wait()  # still at it when the reader stops
        finished.append(text)

    try:
        await send(producer, log, "a", 0)
        await send(producer, log, "a", 1, final=True)
        reader = RolledLogReader(bus, group, handle)
        await reader.start()
        try:
            await wait_for(stuck.is_set)
        finally:
            await reader.stop()
        assert finished == ["a:0"]
        again = RolledLogReader(bus, group, texts_into(finished))
        await again.start()
        try:
            await wait_for(lambda: finished == ["a:0", "a:1"])
            await asyncio.sleep(0.3)
            assert finished == ["a:0", "a:1"]  # the first was not read again
        finally:
            await again.stop()
    finally:
        await producer.stop()
        await admin.close()


async def test_a_ring_for_a_log_the_reader_does_not_read_makes_it_look_at_once(bus, monkeypatch):
    """A router makes its first logs at its start and writes to one at once: the reader learns of
    it from the writer's ring (the stack's doorbell), not from its next listing."""
    assert bus.doorbell_url
    monkeypatch.setattr(rolled_logs, "DISCOVER_EVERY_S", 3600.0)  # only the start's listing, and rings
    got: list[str] = []

    catalog = TopicCatalog(bus)
    admin = TopicAdmin(bus.bootstrap_servers)
    await admin.start()
    earlier = catalog.rolled_reply_log("r1", int(time.time() * 1000))
    await admin.create(earlier, partitions=1)  # so that the reader reads one log when the ring comes
    reader = RolledLogReader(bus, f"{bus.topic_prefix}moderation", texts_into(got))
    await reader.start()
    producer = make_producer(bus)  # rings as it writes
    await producer.start()
    try:
        assert reader.reading == [earlier]
        later = catalog.rolled_reply_log("r1", int(time.time() * 1000) + 1)
        await admin.create(later, partitions=1)
        await send(producer, later, "b", 0, final=True)
        await wait_for(lambda: got == ["b:0"])
        assert reader.reading == sorted([earlier, later])
    finally:
        await reader.stop()
        await producer.stop()
        await admin.close()


async def test_a_reader_follows_logs_as_they_come_and_resumes_where_it_committed(bus, monkeypatch):
    monkeypatch.setattr(rolled_logs, "LET_GO_AFTER_S", 0.5)
    monkeypatch.setattr(rolled_logs, "DISCOVER_EVERY_S", 0.2)
    catalog = TopicCatalog(bus)
    group = f"{bus.topic_prefix}moderation"
    got: list[str] = []
    let_go: list[str] = []

    admin = TopicAdmin(bus.bootstrap_servers)
    await admin.start()
    producer = make_producer(bus)
    await producer.start()
    older = catalog.rolled_reply_log("r1", int(time.time() * 1000))
    await admin.create(older, partitions=1)
    await send(producer, older, "a", 0)  # written before the reader starts: read from the start
    reader = RolledLogReader(bus, group, texts_into(got), on_let_go=let_go.append)
    await reader.start()
    try:
        await wait_for(lambda: got == ["a:0"])
        newer = catalog.rolled_reply_log("r1", int(time.time() * 1000) + 1)
        await admin.create(newer, partitions=1)
        await send(producer, newer, "b", 0)
        await send(producer, newer, "b", 1, final=True)
        await wait_for(lambda: got == ["a:0", "b:0", "b:1"])
        await wait_for(lambda: let_go == [older])  # a newer log of its router exists, the older is quiet
        assert reader.reading == [newer]
    finally:
        await reader.stop()

    await send(producer, newer, "c", 0, final=True)
    again = RolledLogReader(bus, group, texts_into(got))
    await again.start()
    try:
        await wait_for(lambda: got[3:] == ["c:0"])  # from the committed position: nothing twice
        await asyncio.sleep(0.5)
        assert got == ["a:0", "b:0", "b:1", "c:0"]
    finally:
        await again.stop()
        await producer.stop()
        await admin.close()


async def test_the_log_a_router_writes_is_not_let_go_for_the_one_it_made_ahead(bus, monkeypatch):
    """A router makes its next log a rotation before it moves there, so the log it writes has a newer
    one all along: however long a quiet spell, the reader keeps reading the log new streams go to
    (letting it go would leave them unmoderated) until a record on the newer log says the router moved."""
    monkeypatch.setattr(rolled_logs, "LET_GO_AFTER_S", 0.3)
    monkeypatch.setattr(rolled_logs, "DISCOVER_EVERY_S", 0.1)
    catalog = TopicCatalog(bus)
    got: list[str] = []
    let_go: list[str] = []

    admin = TopicAdmin(bus.bootstrap_servers)
    await admin.start()
    now_ms = int(time.time() * 1000)
    current, ahead = catalog.rolled_reply_log("r1", now_ms), catalog.rolled_reply_log("r1", now_ms + 1)
    for log in (current, ahead):
        await admin.create(log, partitions=1)
    reader = RolledLogReader(bus, f"{bus.topic_prefix}moderation", texts_into(got), on_let_go=let_go.append)
    await reader.start()
    producer = make_producer(bus)
    await producer.start()
    try:
        await asyncio.sleep(1.0)  # a quiet spell: more than LET_GO_AFTER_S, several listings
        assert let_go == [] and reader.reading == sorted([current, ahead])
        await send(producer, current, "a", 0, final=True)
        await wait_for(lambda: got == ["a:0"])
        await send(producer, ahead, "b", 0, final=True)  # the router moved on
        await wait_for(lambda: let_go == [current])
        assert got == ["a:0", "b:0"] and reader.reading == [ahead]
    finally:
        await reader.stop()
        await producer.stop()
        await admin.close()


async def test_a_reader_given_its_own_fetch_wait_keeps_it_whenever_records_flow(bus, monkeypatch):
    """Output moderation reads with a longer wait than the request path (stream_processors'
    ``output_moderation_fetch_wait_ms``): its first fetches, and those after an idle spell that a
    ring ended, ask for that wait, not the profile's."""
    monkeypatch.setitem(bus_clients.PROFILES, "embedded",
                        dataclasses.replace(bus_clients.PROFILES["embedded"], idle_after_s=0.3))
    got: list[str] = []

    admin = TopicAdmin(bus.bootstrap_servers)
    await admin.start()
    log = TopicCatalog(bus).rolled_reply_log("r1", int(time.time() * 1000))
    await admin.create(log, partitions=1)
    reader = RolledLogReader(bus, f"{bus.topic_prefix}moderation", texts_into(got), fetch_wait_ms=37)
    await reader.start()
    producer = make_producer(bus)  # rings as it writes
    await producer.start()
    try:
        wait_ms = lambda: reader._consumer._fetcher._fetch_max_wait_ms  # noqa: E731  # what aiokafka asks for
        await send(producer, log, "a", 0)
        await wait_for(lambda: got == ["a:0"])
        assert wait_ms() == 37
        await wait_for(lambda: reader._pacer.idle)
        assert wait_ms() == bus_clients.PROFILES["embedded"].idle_fetch_max_wait_ms
        await asyncio.sleep(0.6)  # past the producer's ring rate limit, so this write rings
        await send(producer, log, "a", 1, final=True)
        await wait_for(lambda: got == ["a:0", "a:1"])
        assert wait_ms() == 37
    finally:
        await reader.stop()
        await producer.stop()
        await admin.close()
