"""ReplyStream's ordering and dedup rules, its idle timeout and its direct reader, and a group of
them (ReplyGroup), without a broker."""

import asyncio

import pytest

from tokenbus.schemas import TokenEvent
from tokenbus.topics import STREAM_IDLE, ReplyEvent, ReplyGroup, ReplyStream, ReplyStreamError
from tokenbus.topics.reply_stream import _IdleWatch


def reply(seq: int, text: str = "", final: bool = False, offset: int | None = None) -> ReplyEvent:
    event = TokenEvent("r", seq, text or f"t{seq}", finish_reason="stop" if final else None)
    return ReplyEvent(event, partition=2, offset=100 + seq if offset is None else offset)


async def drain(stream: ReplyStream) -> list[int]:
    return [r.event.seq async for r in stream.events(idle_timeout=1)]


async def test_duplicates_are_dropped_and_order_is_restored():
    stream = ReplyStream("r")
    for seq in [0, 0, 2, 1, 1, 3, 2]:
        stream.offer(reply(seq))
    stream.offer(reply(4, final=True))
    stream.offer(reply(4, final=True))
    assert await drain(stream) == [0, 1, 2, 3, 4]
    assert stream.done


async def test_nothing_after_the_final_event_is_delivered():
    stream = ReplyStream("r")
    stream.offer(reply(0, final=True))
    stream.offer(reply(1))
    assert await drain(stream) == [0]


async def test_a_stream_ended_after_its_final_event_yields_nothing_more():
    stream = ReplyStream("r")
    stream.next_seq = 5  # a resume learned that seqs 0..4, the final one included, were delivered
    stream.end()
    stream.offer(reply(5))
    assert await drain(stream) == []
    assert stream.done


async def test_event_id_locates_the_record():
    assert reply(3, offset=77).event_id == "2-77"


async def test_overflow_fails_the_stream_instead_of_blocking_the_router():
    stream = ReplyStream("r", queue_size=4)
    for seq in range(10):
        stream.offer(reply(seq))
    with pytest.raises(ReplyStreamError, match="overflowed"):
        await drain(stream)


async def test_idle_timeout_raises():
    stream = ReplyStream("r")
    with pytest.raises(ReplyStreamError, match="no token event"):
        async for _ in stream.events(idle_timeout=0.05):
            pass


def truncation(seq: int) -> ReplyEvent:
    event = TokenEvent("r", seq, finish_reason="content_filter", truncate=True, worker_id="moderation")
    return ReplyEvent(event, partition=2, offset=500)


async def test_a_truncation_ends_the_stream_where_the_reader_is():
    """Output moderation's stop arrives with a seq the stream may already have passed: it still ends it,
    and events held back for later seqs, or arriving after it, are never delivered."""
    stream = ReplyStream("r")
    for seq in [0, 1, 2, 4]:  # 4 waits for 3
        stream.offer(reply(seq))
    stream.offer(truncation(1))
    stream.offer(reply(3))
    stream.offer(reply(5, final=True))
    delivered = [r.event async for r in stream.events(idle_timeout=1)]
    assert [e.seq for e in delivered] == [0, 1, 2, 1]
    assert delivered[-1].truncate and delivered[-1].finish_reason == "content_filter"
    assert stream.done


async def test_a_truncation_after_the_final_event_changes_nothing():
    stream = ReplyStream("r")
    stream.offer(reply(0))
    stream.offer(reply(1, final=True))
    stream.offer(truncation(1))
    assert await drain(stream) == [0, 1]


async def test_the_idle_timeout_counts_from_the_start_of_each_wait():
    """Events 0.15 s apart for two timeouts of 0.5 s: no wait lasts a timeout, so none ends the
    stream. A reader busy for longer than a timeout then waits 0.1 s for the next event: its wait,
    not the time since the last event, is what counts."""
    loop = asyncio.get_running_loop()
    stream = ReplyStream("r")
    for seq in range(7):
        loop.call_later(0.15 * (seq + 1), stream.offer, reply(seq))
    read = []
    async for r in stream.events(idle_timeout=0.5):
        read.append(r.event.seq)
        if r.event.seq == 6:
            await asyncio.sleep(0.7)  # busy, past a timeout since the last event
            loop.call_later(0.1, stream.offer, reply(7, final=True))
    assert read == list(range(8))

    quiet = ReplyStream("q")
    started = loop.time()
    with pytest.raises(ReplyStreamError, match="no token event") as idle:
        async for _ in quiet.events(idle_timeout=0.1):
            pass
    assert idle.value.code == STREAM_IDLE and loop.time() - started >= 0.1


async def test_one_watch_keeps_every_readers_idle_timeout_and_goes_when_they_do():
    """Idle timeouts are kept by one watch per event loop, not a timer per stream: a quiet stream's
    wait ends after its timeout while a fed stream beside it goes on to its end, and once neither
    reads, nothing of the watch is left."""
    loop = asyncio.get_running_loop()
    quiet, fed = ReplyStream("q"), ReplyStream("f")
    for seq in range(8):
        loop.call_later(0.06 * (seq + 1), fed.offer, reply(seq, final=seq == 7))

    async def read_quiet() -> tuple[str, float]:
        started = loop.time()
        with pytest.raises(ReplyStreamError) as idle:
            async for _ in quiet.events(idle_timeout=0.2):
                pass
        return idle.value.code, loop.time() - started

    async def read_fed() -> list[int]:
        read = []
        async for r in fed.events(idle_timeout=0.2):
            read.append(r.event.seq)
            if r.event.seq == 0:
                assert set(_IdleWatch._watches[loop]._readers) == {quiet, fed}
        return read

    (code, waited), read = await asyncio.gather(read_quiet(), read_fed())
    assert code == STREAM_IDLE and 0.2 <= waited < 0.2 + 1.0
    assert read == list(range(8))
    assert loop not in _IdleWatch._watches


def taker(taken: list[int]):
    """A ``direct`` that takes every event but the final one, noting its seq."""
    def take(r: ReplyEvent) -> bool:
        if r.event.is_final:
            return False
        taken.append(r.event.seq)
        return True
    return take


async def test_direct_takes_what_arrives_while_the_reader_waits_and_leaves_the_rest_queued_in_order():
    """Events that come while the reader waits with nothing queued go to ``direct``, in the offering
    call and without waking the reader; one it leaves (here the final) wakes the reader, and nothing
    comes to ``direct`` while the reader has events to read: every event once, in seq order."""
    stream = ReplyStream("r")
    taken: list[int] = []
    stream.direct = taker(taken)
    read = []

    async def reader() -> None:
        async for r in stream.events(idle_timeout=5):
            read.append(r.event.seq)

    stream.offer(reply(0))  # before the reader waits: queued
    task = asyncio.create_task(reader())
    await asyncio.sleep(0.01)
    assert read == [0] and taken == []
    for seq in (2, 1, 3):  # out of order: 1 restores 1, 2 and 3 in order
        stream.offer(reply(seq))
    assert taken == [1, 2, 3] and read == [0]  # taken in the offering calls; the reader slept through them
    stream.offer(reply(4, final=True))
    await task
    assert read == [0, 4] and taken == [1, 2, 3]


async def test_events_taken_by_direct_keep_a_stream_from_idling_out():
    loop = asyncio.get_running_loop()
    stream = ReplyStream("r")
    taken: list[int] = []
    stream.direct = taker(taken)
    for seq in range(1, 9):  # 0.48 s of events, each 0.06 s apart, against an idle timeout of 0.2 s
        loop.call_later(0.06 * seq, stream.offer, reply(seq))
    loop.call_later(0.6, stream.offer, reply(9, final=True))
    stream.offer(reply(0))
    assert [r.event.seq async for r in stream.events(idle_timeout=0.2)] == [0, 9]
    assert taken == list(range(1, 9))

    quiet = ReplyStream("q")  # an event taken, then nothing: the wait ends a timeout after that event
    quiet.direct = taker([])
    loop.call_later(0.05, quiet.offer, reply(0))
    started = loop.time()
    with pytest.raises(ReplyStreamError) as idle:
        async for _ in quiet.events(idle_timeout=0.2):
            pass
    assert idle.value.code == STREAM_IDLE and loop.time() - started >= 0.25


async def test_a_group_delivers_its_members_events_as_they_arrive_until_every_member_has_ended():
    first, second = ReplyStream("c-0"), ReplyStream("c-1")
    group = ReplyGroup("c", [first, second])
    assert group.request_ids == ("c-0", "c-1")
    first.offer(reply(0, "a0"))
    second.offer(reply(1, "early"))  # held by its member until seq 0 comes
    second.offer(reply(0, "b0"))
    first.offer(reply(0, "a0"))  # a repeat: dropped by its member
    first.offer(reply(1, "a-end", final=True))
    assert not group.done
    second.offer(reply(2, "b-end", final=True))
    assert group.done
    assert [r.event.text async for r in group.events(idle_timeout=1)] == ["a0", "b0", "early", "a-end", "b-end"]


async def test_a_member_that_fails_fails_the_group_and_an_idle_group_times_out():
    first, second = ReplyStream("c-0"), ReplyStream("c-1")
    group = ReplyGroup("c", [first, second])
    first.offer(reply(0, "a0"))
    second.fail(ReplyStreamError("gone", "bus_unavailable"))
    events = group.events(idle_timeout=1)
    assert (await anext(events)).event.text == "a0"
    with pytest.raises(ReplyStreamError) as failed:
        await anext(events)
    assert failed.value.code == "bus_unavailable"

    quiet = ReplyGroup("q", [ReplyStream("q-0")])
    with pytest.raises(ReplyStreamError) as idle:
        [r async for r in quiet.events(idle_timeout=0.05)]
    assert idle.value.code == STREAM_IDLE


async def test_a_group_whose_reader_falls_behind_fails_as_a_stream_would():
    members = [ReplyStream("c-0", queue_size=2), ReplyStream("c-1", queue_size=2)]
    group = ReplyGroup("c", members)
    for seq in range(6):  # more than the members would hold apart
        members[seq % 2].offer(reply(seq // 2))
    events = group.events(idle_timeout=1)
    assert [(await anext(events)).event.seq for _ in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ReplyStreamError) as overflowed:
        await anext(events)
    assert overflowed.value.code == "stream_overflow"
