"""ReplyRouter against the real broker: demultiplexing, dedup, and undecodable records."""

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from tests.waiting import wait_for
from tokenbus.infra.devstack.broker import broker_argv
from tokenbus.infra.devstack.processes import free_port, port_open, wait_until
from tokenbus.schemas import AvroCodec, TokenEvent
from tokenbus.topics import BusSettings, ReplyRouter, TopicCatalog, ensure_topics, make_producer

codec = AvroCodec()


async def test_router_demultiplexes_partition_into_ordered_streams(each_bus):
    tokens = TopicCatalog(each_bus).tokens
    router = ReplyRouter(each_bus, partitions=[3])
    await router.start()
    producer = make_producer(each_bus)
    await producer.start()
    try:
        a, b = router.open("req-a"), router.open("req-b")

        async def send(request_id: str, seq: int, final: bool = False) -> None:
            event = TokenEvent(request_id, seq, f"{request_id}:{seq}", [seq], finish_reason="stop" if final else None)
            await producer.send_and_wait(tokens, codec.encode(event), key=request_id.encode(), partition=3)

        await send("req-a", 0)
        await send("req-b", 0)
        await producer.send_and_wait(tokens, b"not avro", key=b"req-a", partition=3)
        await send("req-a", 0)  # a redelivery
        await send("req-a", 1)
        await send("req-x", 0)  # nobody here asked for this one
        await send("req-b", 1, final=True)
        await send("req-a", 2, final=True)

        got_a = [r async for r in a.events(idle_timeout=5)]
        got_b = [r async for r in b.events(idle_timeout=5)]
    finally:
        await producer.stop()
        await router.stop()

    assert [r.event.text for r in got_a] == ["req-a:0", "req-a:1", "req-a:2"]
    assert [r.event.text for r in got_b] == ["req-b:0", "req-b:1"]
    assert all(r.partition == 3 for r in got_a + got_b)
    offsets = [r.offset for r in got_a]
    assert offsets == sorted(offsets) and len(set(offsets)) == 3
    assert router.undecodable == 1
    assert router.open_streams == 0


def read_partitions(router: ReplyRouter) -> set[int]:
    return {tp.partition for tp in router.reading}


async def test_router_rotates_new_requests_and_keeps_reading_open_streams(each_bus):
    """New requests move to the next owned partition; a stream opened before the move still
    gets every event on the old one, and the old one stops being read once its streams end."""
    tokens = TopicCatalog(each_bus).tokens
    router = ReplyRouter(each_bus, partitions=[1, 2], rotate_every_s=0.3)
    producer = make_producer(each_bus)
    await producer.start()
    # Events from before the router started belong to nobody: a rotation starts from the end.
    stale = TokenEvent("req-late", 0, "stale", [0], finish_reason="stop")
    await producer.send_and_wait(tokens, codec.encode(stale), key=b"req-late", partition=2)
    await router.start()

    async def send(request_id: str, partition: int, seq: int, final: bool = False) -> None:
        event = TokenEvent(request_id, seq, f"{request_id}:{seq}", [seq], finish_reason="stop" if final else None)
        await producer.send_and_wait(tokens, codec.encode(event), key=request_id.encode(), partition=partition)

    try:
        assert router.reply_partition == 1 and read_partitions(router) == {1}
        early = router.open("req-early", router.reply_partition)
        await send("req-early", 1, 0)
        await wait_for(lambda: router.reply_partition == 2)
        late = router.open("req-late", router.reply_partition)
        assert read_partitions(router) == {1, 2}
        await send("req-late", 2, 0)
        await send("req-early", 1, 1, final=True)
        await send("req-late", 2, 1, final=True)
        got_early = [r async for r in early.events(idle_timeout=5)]
        got_late = [r async for r in late.events(idle_timeout=5)]
        await wait_for(lambda: 1 not in read_partitions(router) or router.reply_partition == 1)
    finally:
        await producer.stop()
        await router.stop()

    assert [(r.partition, r.event.text) for r in got_early] == [(1, "req-early:0"), (1, "req-early:1")]
    assert [(r.partition, r.event.text) for r in got_late] == [(2, "req-late:0"), (2, "req-late:1")]
    assert router.rotations >= 1


async def send_unasked(producer, tokens: str, partition: int) -> None:
    """An event no open stream asked for: it makes the partition written, and is dropped."""
    event = TokenEvent("req-nobody", 0, "unasked", [0], finish_reason="stop")
    await producer.send_and_wait(tokens, codec.encode(event), key=b"req-nobody", partition=partition)


@contextlib.asynccontextmanager
async def rotating_router(bus: BusSettings, partitions: list[int]) -> AsyncIterator[tuple[ReplyRouter, AIOKafkaProducer]]:
    """A router rotating every 0.2 s of writing, and a producer to write to its partitions."""
    router = ReplyRouter(bus, partitions=partitions, rotate_every_s=0.2)
    await router.start()
    producer = make_producer(bus)
    await producer.start()
    try:
        yield router, producer
    finally:
        await producer.stop()
        await router.stop()


async def test_router_reads_a_partition_again_for_a_stream_opened_on_it(each_bus):
    """A request that took its reply partition just before a rotation still gets its events,
    from the position the router last routed there, even once that partition is no longer read."""
    tokens = TopicCatalog(each_bus).tokens
    async with rotating_router(each_bus, [4, 5]) as (router, producer):
        await send_unasked(producer, tokens, 4)
        await wait_for(lambda: read_partitions(router) == {5})
        stream = router.open("req-straggler", 4)
        assert 4 in read_partitions(router)
        event = TokenEvent("req-straggler", 0, "found", [0], finish_reason="stop")
        await producer.send_and_wait(tokens, codec.encode(event), key=b"req-straggler", partition=4)
        got = [r async for r in stream.events(idle_timeout=5)]
    assert [(r.partition, r.event.text) for r in got] == [(4, "found")]


@pytest.mark.parametrize("rotate_every_s", [600, 0], ids=["time-far-off", "time-rotation-off"])
async def test_a_burst_of_streams_moves_on_before_the_time_is_up(bus, rotate_every_s):
    """Rotation by count: once ``rotate_after_streams`` were opened on a partition, new streams go
    to the next one at the next tick, long before ``rotate_every_s`` and also with rotation by time
    off; streams resumed on another partition do not count."""
    router = ReplyRouter(bus, partitions=[8, 9, 10], rotate_every_s=rotate_every_s, rotate_after_streams=3)
    await router.start()
    try:
        for i in range(3):
            router.open(f"resumed-{i}", partition=10)
        await asyncio.sleep(1.2)  # a tick passes: streams elsewhere are no burst here
        assert router.reply_partition == 8
        router.open("new-0")
        router.open("new-1", partition=router.reply_partition)  # as the SDK and the edge open theirs
        router.open("new-2", partition=router.reply_partition)
        await wait_for(lambda: router.reply_partition == 9)
        assert router.rotations == 1
    finally:
        await router.stop()


async def test_only_the_seconds_a_partition_is_written_count_towards_its_rotation(each_bus):
    """A router whose current partition takes no events stays on it however long it waits (a
    quiet edge makes no new logs); once events flow it moves on after ``rotate_every_s`` of them."""
    tokens = TopicCatalog(each_bus).tokens
    async with rotating_router(each_bus, [11, 12]) as (router, producer):
        await asyncio.sleep(1.5)  # seven rotation periods, nothing written
        assert router.reply_partition == 11 and router.rotations == 0
        while router.reply_partition == 11:
            await send_unasked(producer, tokens, 11)
            await asyncio.sleep(0.05)
        assert router.reply_partition == 12 and router.rotations == 1


async def test_a_rotation_the_broker_cannot_answer_keeps_the_current_partition(bus, monkeypatch):
    """While the broker is away the end offset of the next partition cannot be read: new requests
    stay where they are, and the next rotation goes ahead once the broker answers."""
    from aiokafka.errors import KafkaTimeoutError

    router = ReplyRouter(bus, partitions=[6, 7], rotate_every_s=0.2)
    await router.start()
    real_end_offset = router._end_offset
    failures = []

    async def unreachable_once(tp: TopicPartition) -> int:
        if not failures:
            failures.append(tp.partition)
            raise KafkaTimeoutError()
        return await real_end_offset(tp)

    monkeypatch.setattr(router, "_end_offset", unreachable_once)
    producer = make_producer(bus)
    await producer.start()
    try:
        await send_unasked(producer, TopicCatalog(bus).tokens, 6)  # the partition is written: time to move on
        await wait_for(lambda: failures)
        assert router.reply_partition == 6 and router.rotations == 0
        await wait_for(lambda: router.reply_partition == 7)
    finally:
        await producer.stop()
        await router.stop()
    assert failures == [7]


@pytest.fixture
def own_broker(bus: BusSettings) -> Iterator[tuple[BusSettings, Callable[[], None]]]:
    """A broker of this test's own (it is killed and started again) and a way to restart it."""
    port = free_port()
    argv = broker_argv("127.0.0.1", port)
    processes = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]

    def restart() -> None:
        processes[-1].kill()
        processes[-1].wait()
        processes.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until(lambda: port_open("127.0.0.1", port), "the restarted broker", timeout=20)

    wait_until(lambda: port_open("127.0.0.1", port), "the broker", timeout=20)
    try:
        yield bus.model_copy(update={"bootstrap_servers": f"127.0.0.1:{port}"}), restart
    finally:
        processes[-1].kill()
        processes[-1].wait()


async def test_router_reads_a_reply_log_that_was_recreated(own_broker):
    """The embedded broker keeps nothing across a restart, and answers a fetch past the end of
    the new, shorter log with no records (Kafka would say OFFSET_OUT_OF_RANGE): the router
    notices that the log ends before its position and reads the new log from its start."""
    bus, restart = own_broker
    catalog = TopicCatalog(bus)
    await ensure_topics(bus.bootstrap_servers, catalog.all_topics())
    router = ReplyRouter(bus, partitions=[0])
    await router.start()
    try:
        async def send(request_id: str, seq: int, final: bool = False) -> None:
            producer = make_producer(bus)
            await producer.start()
            try:
                event = TokenEvent(request_id, seq, f"{request_id}:{seq}", [seq], finish_reason="stop" if final else None)
                await producer.send_and_wait(catalog.tokens, codec.encode(event), key=request_id.encode(), partition=0)
            finally:
                await producer.stop()

        before = router.open("before")
        for seq in range(20):
            await send("before", seq, final=seq == 19)
        assert len([r async for r in before.events(idle_timeout=10)]) == 20

        restart()
        await ensure_topics(bus.bootstrap_servers, catalog.all_topics())
        after = router.open("after")
        await send("after", 0, final=True)
        got = [r.event.text async for r in after.events(idle_timeout=15)]
    finally:
        await router.stop()
    assert got == ["after:0"]
