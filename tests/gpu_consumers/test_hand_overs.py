"""The GPU consumer on the embedded broker's express lane (topics/doorbell.py), with the real
broker and real Redis: it hands over every token event of a reply partition it sends few streams to
(another client loading it changes nothing), nothing under load, and takes a request handed over by
its publisher where its next fetch would have found it, or right after the last it took so."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer

from tests.conftest import MODEL
from tests.gpu_consumers.helpers import read_all, running_worker
from tests.topics.express import codec, handed_over
from tests.waiting import wait_for
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import ChatMessage, ChatRequest, Completion, TokenEvent
from tokenbus.topics import BusSettings, FetchPacer, TopicCatalog, make_producer
from tokenbus.topics.doorbell import Doorbell


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
