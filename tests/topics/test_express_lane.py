"""The express lane of the embedded broker's doorbell (topics/doorbell.py), with the real broker
and real Redis: a publisher hands over exactly the records it is asked to, at the offsets the
broker gave them; a reply router offers a handed-over event to its stream, which keeps one copy
whichever comes first, and while the lane brings every event its fetches back it up at the
express wait; a GPU consumer hands over every token event of a reply partition it sends few
streams to (another loading it changes nothing), and takes a request handed over by its
publisher where its next fetch would have found it, or right after the last it took so;
output moderation's reader of the rolled logs takes each record once, in order, by lane or fetch;
nothing is handed over under load."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as redis
from aiokafka import AIOKafkaProducer, TopicPartition

from tests.conftest import MODEL
from tests.gpu_consumers.helpers import read_all, running_worker
from tests.topics.test_batching import publishing
from tests.waiting import wait_for
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, Completion, TokenEvent
from tokenbus.topics import BusSettings, FetchPacer, ReplyRouter, TopicCatalog, make_producer
from tokenbus.topics.clients import PROFILES
from tokenbus.topics.doorbell import Doorbell, Handed, express_channel, listen_express
from tokenbus.topics.lane_watch import LaneWatch
from tokenbus.topics.provision import TopicAdmin
from tokenbus.topics.rolled_logs import RolledLogReader

codec = AvroCodec()


@pytest.fixture
def embedded(bus: BusSettings) -> BusSettings:
    assert bus.doorbell_url, "the test stack runs Redis, so its bus has a doorbell"
    return bus.model_copy(update={"broker": "embedded"})


@contextlib.asynccontextmanager
async def handed_over(settings: BusSettings, topics_starting: str) -> AsyncIterator[list[Handed]]:
    """What is handed over on the express lanes of topics whose names start with ``topics_starting``."""
    assert settings.doorbell_url
    got: list[Handed] = []
    probe, listening = topics_starting + "~listening", asyncio.Event()

    def heard(handed: Handed) -> None:
        if handed.topic == probe:
            listening.set()
        else:
            got.append(handed)

    client = redis.Redis.from_url(settings.doorbell_url)
    task = asyncio.create_task(listen_express(settings.doorbell_url, topics_starting, heard))
    try:
        for _ in range(500):  # listening once a probe of its own comes back
            await client.publish(express_channel(probe), bytes(16))  # partition, offset, an empty key
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(listening.wait(), 0.01)
            if listening.is_set():
                break
        assert listening.is_set(), "the test's express listener never subscribed"
        yield got
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


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


async def test_what_one_pass_hands_over_goes_to_redis_at_once_and_arrives_in_order(embedded, monkeypatch):
    """A GPU consumer's step hands over the events of several light streams in one pass of its event
    loop: they go to Redis in one pipeline, not a round trip each, and every one arrives, in the
    order handed; the next pass's go in another."""
    round_trips: list[int] = []
    real_execute = redis.client.Pipeline.execute

    async def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        round_trips.append(len(self.command_stack))
        return await real_execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    topic = TopicCatalog(embedded).tokens
    assert embedded.doorbell_url
    lane = Doorbell(embedded.doorbell_url, embedded.topic_prefix, ring_every_s=60)
    real_publish = lane._redis.publish  # a publish alone (a pipeline's are queued by the class's)

    async def publish(*args: Any, **kwargs: Any) -> Any:
        round_trips.append(1)
        return await real_publish(*args, **kwargs)

    monkeypatch.setattr(lane._redis, "publish", publish)
    try:
        async with handed_over(embedded, topic) as got:
            round_trips.clear()  # the probe of handed_over's listener
            for offset in range(12):
                lane.hand_over(topic, 2, offset, f"r{offset % 3}".encode(), codec.encode(TokenEvent("r", offset, "t")))
            await wait_for(lambda: len(got) == 12, 10, "the first pass's hand-overs")
            lane.hand_over(topic, 2, 12, b"r0", codec.encode(TokenEvent("r", 12, "t")))
            await wait_for(lambda: len(got) == 13, 10, "the next pass's")
    finally:
        await lane.close()
    assert [(h.partition, h.offset, h.key) for h in got] == [(2, o, f"r{o % 3}".encode()) for o in range(13)]
    assert round_trips == [12, 1]


async def test_a_router_takes_a_handed_over_event_once_whichever_copy_comes_first(embedded):
    router = ReplyRouter(embedded, partitions=[0], rotate_every_s=3600, roll_logs=True, keep_s=60.0)
    await router.start()
    producer = make_producer(embedded)
    await producer.start()
    assert embedded.doorbell_url
    lane = Doorbell(embedded.doorbell_url, embedded.topic_prefix, ring_every_s=60)
    log = TopicPartition(router.reply_topic, router.reply_partition)

    async def write(request_id: str, seq: int, final: bool = False) -> int:
        event = TokenEvent(request_id, seq, f"{request_id}:{seq}", [seq], finish_reason="stop" if final else None)
        written = await producer.send_and_wait(log.topic, codec.encode(event), key=request_id.encode(),
                                               partition=log.partition)
        return int(written.offset)

    def hand(request_id: str, seq: int, offset: int) -> None:
        value = codec.encode(TokenEvent(request_id, seq, f"{request_id}:{seq}", [seq]))
        lane.hand_over(log.topic, log.partition, offset, request_id.encode(), value)

    try:
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
    finally:
        await lane.close()
        await producer.stop()
        await router.stop()
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


async def test_a_light_gpu_consumer_hands_over_every_token_event(embedded):
    """While it runs at most ``LIGHT_IN_FLIGHT`` sequences, a GPU consumer hands over each event it
    publishes (the first is what a client waits for; with all of them on the lane the edge's
    fetches only back it up), once, with the bytes and offset the log has."""
    tokens = TopicCatalog(embedded).tokens
    async with (handed_over(embedded, tokens) as got, running_worker(embedded, min_tokens=4, max_tokens=4),
                TokenbusClient(embedded, idle_timeout=20) as client):
        requests = [client.new_request(MODEL, [ChatMessage("user", f"question {i}")]) for i in range(3)]
        streams = [[r async for r in client.stream(request)] for request in requests]  # one at a time
        await wait_for(lambda: len(got) >= 12, 10, "a hand-over per event", lambda: f"{len(got)} of 12")
        await asyncio.sleep(0.2)  # none more comes
    assert all(len(stream) == 4 for stream in streams)
    handed = sorted((event.request_id, event.seq) for event in (codec.decode(h.value, TokenEvent) for h in got))
    assert handed == sorted((r.request_id, seq) for r in requests for seq in range(4))
    written = {(r.partition, r.offset): (r.key, r.value) for r in await read_all(embedded, tokens, expected=12)}
    assert len(written) == 12
    assert all(written[h.partition, h.offset] == (h.key, h.value) for h in got)


async def test_a_light_reader_keeps_its_lane_while_another_loads_the_gpu_consumer(embedded):
    """A GPU consumer decides the hand-over by reply partition: while one client (an edge under
    load) runs more than ``LIGHT_IN_FLIGHT`` streams on it, another with one stream on a reply
    partition of its own still gets every event of that stream on the lane, and the loaded
    partition's events come by fetch alone."""
    tokens = TopicCatalog(embedded).tokens
    async with (handed_over(embedded, tokens) as got,
                running_worker(embedded, tokens_per_s=50, min_tokens=60, max_tokens=60) as worker,
                TokenbusClient(embedded, reply_partitions=[0], idle_timeout=20) as loading,
                TokenbusClient(embedded, reply_partitions=[1], idle_timeout=20) as light):
        load = [loading.new_request(MODEL, [ChatMessage("user", f"load {i}")]) for i in range(FetchPacer.LIGHT_IN_FLIGHT + 2)]

        async def stream_of(client: TokenbusClient, request: ChatRequest) -> list[int]:
            return [r.event.seq async for r in client.stream(request)]

        loaded = [asyncio.create_task(stream_of(loading, request)) for request in load]
        await wait_for(lambda: worker.running == len(load), 10, "the load running")
        lone = light.new_request(MODEL, [ChatMessage("user", "alone")], max_tokens=10)
        lone_seqs = await stream_of(light, lone)
        assert worker.running == len(load), "the load outlasts the lone stream"
        loaded_seqs = await asyncio.gather(*loaded)
    assert lone_seqs == list(range(10)) and all(seqs == list(range(60)) for seqs in loaded_seqs)
    handed = [codec.decode(h.value, TokenEvent) for h in got]
    assert sorted(e.seq for e in handed if e.request_id == lone.request_id) == list(range(10))
    assert not [e for e in handed if e.request_id in {r.request_id for r in load} and e.seq < 50]


async def test_nothing_is_handed_over_under_load(embedded, monkeypatch):
    """Under load fetches return records at once and a hand-over only adds work: the edge hands a
    request over, and a GPU consumer its token events, only while it serves at most
    ``LIGHT_IN_FLIGHT`` streams or sequences (here none, so that one request is already load)."""
    monkeypatch.setattr(FetchPacer, "LIGHT_IN_FLIGHT", 0)
    catalog = TopicCatalog(embedded)
    async with (handed_over(embedded, catalog.tokens) as tokens_handed,
                handed_over(embedded, catalog.requests(MODEL, embedded.tiers[-1])) as requests_handed,
                running_worker(embedded, min_tokens=2, max_tokens=2) as worker,
                TokenbusClient(embedded, idle_timeout=20) as client):
        for i in range(2):
            assert len([r async for r in client.stream(client.new_request(MODEL, [ChatMessage("user", f"q{i}")]))]) == 2
        await wait_for(lambda: worker.completed == 2, 10, "both completions")
        await asyncio.sleep(0.3)  # a hand-over would have come long before the streams ended
    assert tokens_handed == [] and requests_handed == []


@dataclass
class WarmWorker:
    """A worker that has served one request fetched from the lowest tier's topic, and what its tests use."""

    topic: str
    lane: Doorbell  # to hand requests over on, as the edge does
    writer: AIOKafkaProducer  # to write them where they were handed over from, without a lane
    worker: Any
    client: TokenbusClient
    warm: ChatRequest
    partition: int  # where the warm request lies
    offset: int


@contextlib.asynccontextmanager
async def beside_a_warm_worker(embedded: BusSettings) -> AsyncIterator[WarmWorker]:
    """A running worker past its first fetch of a partition (so it takes hand-overs there); the
    edge handed over that first request and only it."""
    topic = TopicCatalog(embedded).requests(MODEL, embedded.tiers[-1])
    assert embedded.doorbell_url
    lane = Doorbell(embedded.doorbell_url, embedded.topic_prefix, ring_every_s=60)
    writer = make_producer(embedded.model_copy(update={"express_lane": False}))
    await writer.start()
    try:
        async with (handed_over(embedded, topic) as edge_handed, running_worker(embedded, min_tokens=3, max_tokens=3) as worker,
                    TokenbusClient(embedded, idle_timeout=20) as client):
            warm = client.new_request(MODEL, [ChatMessage("user", "the first, fetched")])
            assert [r.event.seq async for r in client.stream(warm)] == [0, 1, 2]
            assert [codec.decode(h.value, ChatRequest).request_id for h in edge_handed] == [warm.request_id]
            (_, partition, offset, _, _), = edge_handed
            yield WarmWorker(topic, lane, writer, worker, client, warm, partition, offset)
    finally:
        await writer.stop()
        await lane.close()


async def test_a_gpu_consumer_takes_a_handed_over_request_only_where_its_next_fetch_would_be(embedded):
    """The edge hands over each request it publishes to a model's topic. A worker takes one at
    the offset its next fetch of the partition would return, and passes the fetched copy over (the
    request is served once); one at any other offset is left to the fetch."""
    async with beside_a_warm_worker(embedded) as at:
        topic, partition, offset, client = at.topic, at.partition, at.offset, at.client
        # Handed over before it is written: served from the lane alone.
        early = client.new_request(MODEL, [ChatMessage("user", "handed over first")])
        early_stream = client.router.open(early.request_id)
        at.lane.hand_over(topic, partition, offset + 1, early.request_id.encode(), codec.encode(early))
        events = [r.event.seq async for r in early_stream.events(idle_timeout=10)]
        assert events == [0, 1, 2]
        await wait_for(lambda: at.worker.completed == 2, 10, "its completion acknowledged")
        # Its record, written now where it was handed over from, is passed over.
        written = await at.writer.send_and_wait(topic, codec.encode(early), key=early.request_id.encode(),
                                                partition=partition)
        assert written.offset == offset + 1
        # Handed over ahead of the fetch (offset + 3 while the next record is at offset + 2): not taken.
        ahead = client.new_request(MODEL, [ChatMessage("user", "handed over too soon")])
        ahead_stream = client.router.open(ahead.request_id)
        at.lane.hand_over(topic, partition, offset + 3, ahead.request_id.encode(), codec.encode(ahead))
        after = client.new_request(MODEL, [ChatMessage("user", "the next, at offset + 2")])
        await at.writer.send_and_wait(topic, codec.encode(after), key=after.request_id.encode(), partition=partition)
        after_stream = client.router.open(after.request_id)
        assert [r.event.seq async for r in after_stream.events(idle_timeout=10)] == [0, 1, 2]
        await wait_for(lambda: at.worker.completed == 3, 10, "the third request's completion")
        assert ahead_stream.backlog == 0 and not ahead_stream.done
    completions = [codec.decode(r.value, Completion).request_id
                   for r in await read_all(embedded, TopicCatalog(embedded).completions, expected=3)]
    assert sorted(completions) == sorted([at.warm.request_id, early.request_id, after.request_id])


async def test_a_gpu_consumer_takes_hand_overs_in_a_row_ahead_of_its_fetch(embedded):
    """Two requests handed over back to back, before the fetch has returned either (two clients
    at once): the worker takes the second right after the first, serves each once, and passes both
    fetched copies over."""
    async with beside_a_warm_worker(embedded) as at:
        client = at.client
        pair = [client.new_request(MODEL, [ChatMessage("user", f"handed over, {n} of two")]) for n in (1, 2)]
        streams = [client.router.open(request.request_id) for request in pair]
        for n, request in enumerate(pair, start=1):
            at.lane.hand_over(at.topic, at.partition, at.offset + n, request.request_id.encode(), codec.encode(request))
        served = [[r.event.seq async for r in stream.events(idle_timeout=10)] for stream in streams]
        assert served == [[0, 1, 2], [0, 1, 2]]
        await wait_for(lambda: at.worker.completed == 3, 10, "both completions acknowledged")
        for n, request in enumerate(pair, start=1):  # written now where they were handed over from: passed over
            written = await at.writer.send_and_wait(at.topic, codec.encode(request), key=request.request_id.encode(),
                                                    partition=at.partition)
            assert written.offset == at.offset + n
        last = client.new_request(MODEL, [ChatMessage("user", "the next, fetched after them")])
        await at.writer.send_and_wait(at.topic, codec.encode(last), key=last.request_id.encode(), partition=at.partition)
        assert [r.event.seq async for r in client.router.open(last.request_id).events(idle_timeout=10)] == [0, 1, 2]
        await wait_for(lambda: at.worker.completed == 4, 10, "the last request's completion")
    completions = [codec.decode(r.value, Completion).request_id
                   for r in await read_all(embedded, TopicCatalog(embedded).completions, expected=4)]
    assert sorted(completions) == sorted([at.warm.request_id, *(r.request_id for r in pair), last.request_id])


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
