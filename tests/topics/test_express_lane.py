"""The express lane of the embedded broker's doorbell (topics/doorbell.py), with the real broker
and real Redis: a publisher hands over exactly the records it is asked to, at the offsets the
broker gave them, and what one pass hands over goes to Redis at once; a reply router offers a
handed-over event to its stream, which keeps one copy whichever comes first, and while the lane
brings every event its fetches back it up at the express wait; output moderation's reader of the
rolled logs takes each record once, in order, by lane or fetch. The GPU consumer's hand-overs:
tests/gpu_consumers/test_hand_overs.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiokafka import TopicPartition

from tests.gpu_consumers.helpers import read_all
from tests.topics.express import codec, handed_over
from tests.topics.test_batching import publishing
from tests.waiting import wait_for
from tokenbus.schemas import TokenEvent
from tokenbus.topics import ReplyGroup, ReplyRouter, TopicCatalog, make_producer
from tokenbus.topics.clients import PROFILES
from tokenbus.topics.doorbell import Doorbell
from tokenbus.topics.lane_watch import LaneWatch
from tokenbus.topics.provision import TopicAdmin
from tokenbus.topics.rolled_logs import RolledLogReader


@pytest.mark.parametrize("passes_queue", [False, True], ids=["each-pass-acknowledged", "passes-queued"])
async def test_a_publisher_hands_over_what_it_is_asked_to_at_the_offsets_the_broker_gave(embedded, passes_queue):
    """Several passes, and one pass bigger than a Kafka batch (so its records go out as several
    batches, each with its own base offset): every record asked for is handed over once, with the
    offset it has in the log and the bytes stored there; no other record is. Also where passes
    queue behind a batch in flight and go out together, a Kafka batch holding several passes."""
    topic = TopicCatalog(embedded).tokens
    asked: set[str] = set()
    async with handed_over(embedded, topic) as got, publishing(embedded, max_batch_size=16_384) as publisher:
        for step in range(3):
            for n in range(8):  # ~5 KB each: a pass of eight fills about three batches
                text = f"{step}.{n}:" + "x" * 5_000
                hand_over = n in (1, 4, 7) or step == 2 and n == 0
                publisher.publish(topic, 2, f"r{n}", TokenEvent(f"r{n}", step, text), hand_over=hand_over)
                if hand_over:
                    asked.add(text)
            await (asyncio.sleep(0) if passes_queue else publisher.flush())
        await publisher.flush()
        await wait_for(lambda: len(got) >= len(asked), 10, "the hand-overs", lambda: f"{len(got)} of {len(asked)}")
    written = {record.offset: (record.key, record.value) for record in await read_all(embedded, topic, expected=24)}
    assert len(written) == 24
    assert all(h.topic == topic and h.partition == 2 for h in got)
    assert all(written[h.offset] == (h.key, h.value) for h in got)  # the key and value the log holds
    texts = [codec.decode(h.value, TokenEvent).text for h in got]
    assert sorted(texts) == sorted(asked)


async def test_without_the_express_lane_nothing_is_handed_over(embedded):
    topic = TopicCatalog(embedded).tokens
    off = embedded.model_copy(update={"express_lane": False})
    async with handed_over(embedded, topic) as got:
        async with publishing(off) as publisher:
            await publisher.publish(topic, 1, "r", TokenEvent("r", 0, "quiet"), hand_over=True)
        async with publishing(embedded) as publisher:  # a lane that is on, as the control
            await publisher.publish(topic, 1, "r", TokenEvent("r", 1, "handed"), hand_over=True)
        await wait_for(lambda: got, 10, "the control's hand-over")
        await asyncio.sleep(0.2)  # Redis delivers in publish order: the first would have come first
    assert [codec.decode(h.value, TokenEvent).text for h in got] == ["handed"]


async def test_what_one_pass_hands_over_goes_to_redis_at_once_and_arrives_in_order(embedded):
    """A GPU consumer's step hands over the events of several light streams in one pass of its event
    loop: they go to Redis in one write, not a round trip each, with no task to wait for them, and
    every one arrives, in the order handed; the next pass's go in another write."""
    topic = TopicCatalog(embedded).tokens
    assert embedded.doorbell_url
    lane = Doorbell(embedded.doorbell_url, embedded.topic_prefix, ring_every_s=60)
    try:
        async with handed_over(embedded, topic) as got:
            for offset in range(12):
                lane.hand_over(topic, 2, offset, f"r{offset % 3}".encode(), codec.encode(TokenEvent("r", offset, "t")))
            await wait_for(lambda: len(got) == 12, 10, "the first pass's hand-overs")
            tasks = asyncio.all_tasks()
            lane.hand_over(topic, 2, 12, b"r0", codec.encode(TokenEvent("r", 12, "t")))
            assert asyncio.all_tasks() == tasks  # connected: a hand-over is a write, not a task
            await wait_for(lambda: len(got) == 13, 10, "the next pass's")
    finally:
        await lane.close()
    assert [(h.partition, h.offset, h.key) for h in got] == [(2, o, f"r{o % 3}".encode()) for o in range(13)]
    assert (lane.publisher.writes, lane.publisher.dropped) == (2, 0)


class LaneToRouter:
    """A reply router on a rolled log of its own, a producer that writes token events to that log,
    and the express lane that hands them to the router."""

    def __init__(self, embedded) -> None:
        assert embedded.doorbell_url
        self.router = ReplyRouter(embedded, partitions=[0], rotate_every_s=3600, roll_logs=True, keep_s=60.0)
        self.producer = make_producer(embedded)
        self.lane = Doorbell(embedded.doorbell_url, embedded.topic_prefix, ring_every_s=60)

    async def __aenter__(self) -> LaneToRouter:
        await self.router.start()
        await self.producer.start()
        self.log = TopicPartition(self.router.reply_topic, self.router.reply_partition)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.lane.close()
        await self.producer.stop()
        await self.router.stop()

    @staticmethod
    def event(request_id: str, seq: int, final: bool = False) -> bytes:
        return codec.encode(TokenEvent(request_id, seq, f"{request_id}:{seq}", [seq],
                                       finish_reason="stop" if final else None))

    async def write(self, request_id: str, seq: int, final: bool = False) -> int:
        written = await self.producer.send_and_wait(self.log.topic, self.event(request_id, seq, final),
                                                    key=request_id.encode(), partition=self.log.partition)
        return int(written.offset)

    def hand(self, request_id: str, seq: int, offset: int) -> None:
        self.lane.hand_over(self.log.topic, self.log.partition, offset, request_id.encode(), self.event(request_id, seq))


async def test_a_router_takes_a_handed_over_event_once_whichever_copy_comes_first(embedded):
    async with LaneToRouter(embedded) as bus:
        router, write, hand = bus.router, bus.write, bus.hand
        early, late = router.open("req-early"), router.open("req-late")
        early_events, late_events = early.events(idle_timeout=10), late.events(idle_timeout=10)
        # Handed over before it is in the log (its writer is slow to be fetched): the stream has it
        # from the lane alone, at the offset its writer will give it.
        hand("req-early", 0, offset=0)
        first = await asyncio.wait_for(anext(early_events), 10)
        assert (first.event.seq, first.offset) == (0, 0)
        assert await write("req-early", 0) == 0  # the fetched copy comes second: dropped
        # Fetched first, then handed over: the second copy is dropped too.
        late_first = await write("req-late", 0)
        assert (await asyncio.wait_for(anext(late_events), 10)).event.seq == 0
        hand("req-late", 0, late_first)
        hand("req-nobody", 0, late_first + 1)  # no such stream here
        await write("req-early", 1, final=True)
        await write("req-late", 1, final=True)
        rest_early = [r.event.seq async for r in early_events]
        rest_late = [r.event.seq async for r in late_events]
    assert rest_early == [1] and rest_late == [1]
    assert router.open_streams == 0


async def test_a_light_router_backs_the_lane_up_at_the_express_wait_until_the_lane_misses(embedded, monkeypatch):
    """While the lane brings every event of its streams (before the fetched copy, or just after it),
    a light router's fetches only back the lane up, at the profile's express wait; events that come
    by the fetch alone bring the light wait back. Either way each event reaches its stream once, in
    order."""
    monkeypatch.setattr(LaneWatch, "TRUST_AFTER_S", 0.3)
    monkeypatch.setattr(LaneWatch, "GRACE_S", 0.1)
    tuned = PROFILES["embedded"]
    router = ReplyRouter(embedded, partitions=[0], rotate_every_s=3600, roll_logs=True, keep_s=60.0)
    await router.start()
    producer = make_producer(embedded.model_copy(update={"express_lane": False}))  # hands nothing over itself
    await producer.start()
    assert embedded.doorbell_url
    lane = Doorbell(embedded.doorbell_url, embedded.topic_prefix, ring_every_s=60)
    log = TopicPartition(router.reply_topic, router.reply_partition)

    def asked() -> int:
        wait: int = router._consumer._fetcher._fetch_max_wait_ms  # what the router's next fetch asks for
        return wait

    stream = router.open("fed")
    events = stream.events(idle_timeout=10)
    read: list[int] = []

    async def relay_until(wait_ms: int, hand: bool) -> None:
        """Write (and maybe hand over) one event at a time, each read before the next, until the
        router's fetches ask for ``wait_ms``."""
        for _ in range(200):
            seq = len(read)
            value = codec.encode(TokenEvent("fed", seq, f"{seq}", [seq]))
            written = await producer.send_and_wait(log.topic, value, key=b"fed", partition=log.partition)
            if hand:
                lane.hand_over(log.topic, log.partition, written.offset, b"fed", value)
            read.append((await asyncio.wait_for(anext(events), 10)).event.seq)
            await asyncio.sleep(0.02)
            if asked() == wait_ms:
                return
        pytest.fail(f"the router never asked for {wait_ms} ms (asks for {asked()})")

    try:
        await relay_until(tuned.express_fetch_max_wait_ms, hand=True)
        await relay_until(tuned.light_fetch_max_wait_ms, hand=False)
        await relay_until(tuned.express_fetch_max_wait_ms, hand=True)
        final = codec.encode(TokenEvent("fed", len(read), "end", finish_reason="stop"))
        await producer.send_and_wait(log.topic, final, key=b"fed", partition=log.partition)
        read += [r.event.seq async for r in events]
    finally:
        await lane.close()
        await producer.stop()
        await router.stop()
    assert read == list(range(len(read)))


async def test_output_moderation_takes_each_record_of_a_rolled_log_once_in_order_by_lane_or_fetch(embedded, monkeypatch):
    """Output moderation's reader of every rolled log (topics/rolled_logs.py) also takes what
    writers hand over: a hand-over that is the next record of its log is handled at once, with its
    key; the fetched copy is then passed over, and so is a handed-over copy of a record fetched
    first; a hand-over ahead of a record not yet handled is left to the fetch. While the lane brings
    every record its fetches ask for the express wait; records by the fetch alone bring back the
    reader's own wait (not the light one below it)."""
    monkeypatch.setattr(LaneWatch, "TRUST_AFTER_S", 0.3)
    monkeypatch.setattr(LaneWatch, "GRACE_S", 0.1)
    tuned = PROFILES["embedded"]
    log = TopicCatalog(embedded).rolled_reply_log("moderated", int(time.time() * 1000))
    admin = TopicAdmin(embedded.bootstrap_servers)
    await admin.start()
    await admin.create(log, partitions=1)
    handled: list[tuple[int, bytes | None, str]] = []

    async def moderate(record: Any) -> None:
        handled.append((record.offset, record.key, codec.decode(record.value, TokenEvent).text))

    reader = RolledLogReader(embedded, f"{embedded.topic_prefix}moderation", moderate, fetch_wait_ms=37, express=True)
    await reader.start()
    writer = make_producer(embedded.model_copy(update={"express_lane": False}))  # hands nothing over itself
    await writer.start()
    assert embedded.doorbell_url
    lane = Doorbell(embedded.doorbell_url, embedded.topic_prefix, ring_every_s=60)

    def event(seq: int, text: str) -> bytes:
        return codec.encode(TokenEvent("a", seq, text, [seq]))

    async def write(seq: int) -> int:
        return int((await writer.send_and_wait(log, event(seq, f"a:{seq}"), key=b"a", partition=0)).offset)

    def asked() -> int:
        wait: int = reader._consumer._fetcher._fetch_max_wait_ms  # what the reader's next fetch asks for
        return wait

    async def relay_until(wait_ms: int, hand: bool) -> None:
        """Write (and maybe hand over) one event at a time, each handled before the next, until the
        reader's fetches ask for ``wait_ms``."""
        for _ in range(200):
            seq = len(handled)
            offset = await write(seq)
            assert offset == seq
            if hand:
                lane.hand_over(log, 0, offset, b"a", event(seq, f"a:{seq}"))
            await wait_for(lambda: len(handled) == offset + 1, 10, f"event {seq}")  # noqa: B023  # called here
            await asyncio.sleep(0.02)
            if asked() == wait_ms:
                return
        pytest.fail(f"the reader never asked for {wait_ms} ms (asks for {asked()})")

    try:
        # Handed over before it is in the log: handled from the lane alone, key and all (handed over
        # again until the reader's subscription is up).
        for _ in range(500):
            lane.hand_over(log, 0, 0, b"a", event(0, "a:0"))
            await asyncio.sleep(0.02)
            if handled:
                break
        assert handled == [(0, b"a", "a:0")]
        assert await write(0) == 0  # the fetched copy comes second: passed over
        assert await write(1) == 1  # fetched first...
        await wait_for(lambda: len(handled) == 2, 10, "the fetched event")
        lane.hand_over(log, 0, 1, b"a", event(1, "a:1 again"))  # ...so its copy on the lane is passed over
        lane.hand_over(log, 0, 3, b"a", event(3, "a:3 ahead"))  # ahead of offset 2: left to the fetch
        await asyncio.sleep(0.2)
        assert (await write(2), await write(3)) == (2, 3)
        await wait_for(lambda: len(handled) == 4, 10, "the fetched events")
        await asyncio.sleep(0.2)
        assert handled == [(n, b"a", f"a:{n}") for n in range(4)]
        await relay_until(tuned.express_fetch_max_wait_ms, hand=True)
        await relay_until(37, hand=False)
        await relay_until(tuned.express_fetch_max_wait_ms, hand=True)
    finally:
        await lane.close()
        await writer.stop()
        await reader.stop()
        await admin.close()
    assert [offset for offset, *_ in handled] == list(range(len(handled)))
    assert [text for *_, text in handled] == [f"a:{n}" for n in range(len(handled))]


async def test_a_group_s_members_take_fetched_events_alone_so_the_group_keeps_the_log_s_order(embedded):
    """A response's choices (ReplyGroup) come in the order of the log, which resuming them by one
    event id relies on: a hand-over from one writer, ahead of another writer's record at a lower
    offset, is left to the fetch."""
    async with LaneToRouter(embedded) as bus:
        group = ReplyGroup("choices", [bus.router.open("choices-0"), bus.router.open("choices-1")])
        # choices-0's writer hands its first event over at the offset it will have, before
        # choices-1's writer has written the record before it.
        bus.hand("choices-0", 0, offset=1)
        await asyncio.sleep(0.3)
        assert [await bus.write("choices-1", 0), await bus.write("choices-0", 0)] == [0, 1]
        await bus.write("choices-1", 1, final=True)
        await bus.write("choices-0", 1, final=True)
        offsets = [r.offset async for r in group.events(idle_timeout=10)]
    assert offsets == [0, 1, 2, 3]
