"""KV-cache-aware placement end to end on the real broker: two GPU consumers (simulated engine with
its prefix-cache model) in one group report what they cache; the client places requests by it.
On the embedded broker only: the mock Kafka cluster cannot run a two-member group (see
docs/architecture.md, "A second Kafka in the tests")."""

import asyncio
import contextlib

from aiokafka.partitioner import DefaultPartitioner

from tests.conftest import MODEL
from tests.gpu_consumers.helpers import read_all, running_worker
from tests.waiting import wait_for
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import AvroCodec, ChatMessage, Completion
from tokenbus.schemas.prefixes import segment_hashes
from tokenbus.topics import TopicCatalog

codec = AvroCodec()
SYSTEM = ChatMessage("system", " ".join(f"rule{i} of the shared assistant" for i in range(60)))  # ~300 tokens
ENGINE = dict(min_tokens=4, max_tokens=4, kv_block_tokens=16)


def owners(client: TokenbusClient, topic: str) -> dict[int, str]:
    return {p: w for (t, p), w in client.placement.index._owners.items() if t == topic}


async def serve(client: TokenbusClient, request) -> list:
    return [r.event async for r in client.stream(request)]


@contextlib.asynccontextmanager
async def two_workers(bus):
    # The client first: its router reads reports from when it starts, so it sees the workers' first
    # ones rather than waiting for their next snapshots (10 s).
    async with (TokenbusClient(bus, idle_timeout=30) as client, running_worker(bus, worker_id="w-a", **ENGINE) as a,
                running_worker(bus, worker_id="w-b", **ENGINE) as b):
        topic = TopicCatalog(bus).requests(MODEL, "standard")
        await wait_for(lambda: a.partitions and b.partitions and a.partitions + b.partitions == 12, what="a balanced group")
        await wait_for(lambda: sorted(set(owners(client, topic).values())) == ["w-a", "w-b"]
                       and len(owners(client, topic)) == 4, what="the router to learn who owns what")
        yield a, b, client


async def completions_of(bus, requests) -> dict[str, Completion]:
    """Each request's completion record (the topic holds the warm-up turn's too)."""
    wanted = {r.request_id for r in requests}
    decoded = lambda records: {c.request_id: c for c in (codec.decode(r.value, Completion) for r in records)}  # noqa: E731
    records = await read_all(bus, TopicCatalog(bus).completions, until=lambda got: wanted <= decoded(got).keys(),
                             timeout=20)
    completions = decoded(records)
    assert wanted <= completions.keys(), f"no completion for {sorted(wanted - completions.keys())}"
    return {r.request_id: completions[r.request_id] for r in requests}


async def test_conversations_sharing_a_system_prompt_go_where_it_is_cached(bus):
    async with two_workers(bus) as (_, _, client):
        first = client.new_request(MODEL, [SYSTEM, ChatMessage("user", "first")], tier="standard",
                                   conversation_id="conv-0")
        assert (await serve(client, first))[-1].finish_reason == "stop"
        system_prefix = segment_hashes(first)[0]
        await wait_for(lambda: system_prefix in client.placement.index._holders, what="the cache report")
        (holder,) = client.placement.index._holders[system_prefix]

        later = [client.new_request(MODEL, [SYSTEM, ChatMessage("user", f"question {i}")], tier="standard",
                                    conversation_id=f"conv-{i}") for i in range(1, 11)]
        for request in later:  # one after another, as a conversation's users would
            events = await serve(client, request)
            assert events[-1].finish_reason == "stop"
            assert events[-1].cached_tokens and events[-1].cached_tokens >= 256
        completions = await completions_of(bus, [first, *later])

    assert completions[first.request_id].annotations["route"] in ("miss", "unknown")
    for request in later:
        completion = completions[request.request_id]
        assert completion.worker_id == holder  # by key alone, ten conversations would spread over both
        assert completion.annotations["route"] == "prefix"
        assert completion.annotations["route.worker"] == holder
        assert int(completion.annotations["route.hit_tokens"]) >= 256
        assert completion.cached_prompt_tokens >= 256


async def test_a_worker_leaving_moves_its_prefixes_traffic_with_no_failed_request(bus):
    async with two_workers(bus) as (a, b, client):
        first = client.new_request(MODEL, [SYSTEM, ChatMessage("user", "warm up")], tier="standard",
                                   conversation_id="warm")
        await serve(client, first)
        system_prefix = segment_hashes(first)[0]
        await wait_for(lambda: system_prefix in client.placement.index._holders, what="the cache report")
        (holder,) = client.placement.index._holders[system_prefix]
        leaving, staying = (a, b) if holder == "w-a" else (b, a)
        topic = TopicCatalog(bus).requests(MODEL, "standard")

        requests = [client.new_request(MODEL, [SYSTEM, ChatMessage("user", f"during {i}")], tier="standard",
                                       conversation_id=f"move-{i}") for i in range(8)]
        streams = [asyncio.create_task(serve(client, r)) for r in requests[:4]]
        leaving.stop()  # leaves the group: its partitions and its cache's traffic go to the other
        await wait_for(lambda: holder not in client.placement.index.workers, what="the leaving report")
        await wait_for(lambda: set(owners(client, topic).values()) == {staying.settings.worker_id},
                       what="the survivor to own every partition")
        streams += [asyncio.create_task(serve(client, r)) for r in requests[4:]]
        results = await asyncio.gather(*streams)
        completions = await completions_of(bus, requests)

    assert all(events[-1].finish_reason == "stop" for events in results)
    for request in requests[4:]:
        assert completions[request.request_id].worker_id == staying.settings.worker_id


async def test_with_routing_off_requests_are_placed_by_their_key(bus):
    off = bus.model_copy(update={"prefix_routing": False})
    async with (running_worker(off, worker_id="w-off", **ENGINE), TokenbusClient(off, idle_timeout=30) as client):
        assert client.placement is None
        requests = [client.new_request(MODEL, [SYSTEM, ChatMessage("user", f"q{i}")], tier="standard",
                                       conversation_id=f"key-{i}") for i in range(6)]
        landed = [await client.publish(r) for r in requests]
        reports = await read_all(off, TopicCatalog(off).cache_reports, expected=1, timeout=1)
    partitioner = DefaultPartitioner()
    for request, metadata in zip(requests, landed):
        assert metadata.partition == partitioner(request.partition_key.encode(), [0, 1, 2, 3], [0, 1, 2, 3])
        assert "route" not in request.annotations
    assert reports == []  # workers report nothing either
