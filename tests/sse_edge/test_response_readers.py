"""Who reads a stored response to its end, against the real Redis: the serving reader holds its
lease while it reads and lets go after; a client's reading that stops before the response ended
hands the reading over, one that met the end does not; a reader from the log lets go when its
edge stops (its task cancelled)."""

import asyncio

from tokenbus.schemas import ChatMessage
from tokenbus.sse_edge.plumbing.history import StoredTurn
from tokenbus.sse_edge.plumbing.kept_responses import KeptResponse
from tokenbus.sse_edge.plumbing.response_readers import READER, ReaderLease, read_to_the_end, served_frames
from tokenbus.stores.responses import ResponseStore, new_response_id


def keeping(store: ResponseStore, response_id: str) -> KeptResponse:
    return KeptResponse(store, "acme", "[]", False, [], StoredTurn(response_id, 1, (ChatMessage("user", "hi"),)),
                        chain_turns=4, conversation=response_id)


async def frames_of(kept: KeptResponse, response_id: str, ends: bool):
    yield b"created"
    yield b"delta"
    if ends:
        await kept.ended({"id": response_id, "status": "completed", "output": []})
        yield b"completed"


async def holder(client, prefix: str, response_id: str) -> str | None:
    held = await client.get(f"{prefix}response:{response_id}:reader")
    return held.decode() if held is not None else None


async def test_a_client_that_goes_before_the_end_hands_the_reading_over(each_redis):
    client, prefix = each_redis
    store, response_id = ResponseStore(client, prefix, ttl_s=60), new_response_id()
    kept, handed, lease = keeping(store, response_id), [], ReaderLease(store, response_id, 10.0)
    assert await lease.claim()  # (the serving edge claims it as it stores the response started)
    frames = served_frames(frames_of(kept, response_id, ends=True), kept, lambda: handed.append(1), lease)
    assert await anext(frames) == b"created"
    assert await holder(client, prefix, response_id) == READER  # held while it reads
    await frames.aclose()  # the client went away
    assert handed == [1] and await holder(client, prefix, response_id) is None


async def test_a_reading_that_met_the_end_hands_nothing_over(each_redis):
    client, prefix = each_redis
    store, response_id = ResponseStore(client, prefix, ttl_s=60), new_response_id()
    kept, handed = keeping(store, response_id), []
    frames = served_frames(frames_of(kept, response_id, ends=True), kept, lambda: handed.append(1),
                           ReaderLease(store, response_id, 10.0))
    assert [f async for f in frames] == [b"created", b"delta", b"completed"]
    assert handed == [] and kept.has_ended and await holder(client, prefix, response_id) is None
    stream_broke = keeping(store, response_id)  # a stream that ends without the response's end (it failed)
    assert [f async for f in served_frames(frames_of(stream_broke, response_id, ends=False), stream_broke,
                                           lambda: handed.append(2))] == [b"created", b"delta"]
    assert handed == [2]


async def test_a_reader_from_the_log_lets_go_when_its_edge_stops(each_redis):
    client, prefix = each_redis
    store, response_id = ResponseStore(client, prefix, ttl_s=60), new_response_id()
    lease = ReaderLease(store, response_id, 10.0)
    assert await lease.claim()
    assert not await store.claim_reader(response_id, "edge-other", 1.0)  # held: no other edge reads it
    never_ends = asyncio.Event()

    async def frames():
        yield b"created"
        await never_ends.wait()
        yield b"never"

    reading = asyncio.ensure_future(read_to_the_end(lease, frames()))
    await asyncio.sleep(0.05)
    assert await holder(client, prefix, response_id) == READER
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    assert await holder(client, prefix, response_id) is None  # another edge may take it over at once
