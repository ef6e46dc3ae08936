"""ReplyRouter against the real broker: demultiplexing, dedup, and undecodable records."""

import asyncio

from producers import ReplyRouter
from schemas import AvroCodec, TokenEvent
from topics import TopicCatalog, make_producer

codec = AvroCodec()


async def test_router_demultiplexes_partition_into_ordered_streams(bus):
    tokens = TopicCatalog(bus).tokens
    router = ReplyRouter(bus, partitions=[3])
    await router.start()
    producer = make_producer(bus)
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
