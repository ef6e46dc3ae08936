"""The token log on the real broker: what a taking-over worker finds of a request's events, and
how much of the reply log it reads to find it."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from tests.conftest import MODEL
from tokenbus.gpu_consumers import token_log
from tokenbus.gpu_consumers.token_log import TokenLog
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, TokenEvent, now_ms
from tokenbus.topics import RecordSender, TopicCatalog, delete_topics, ensure_topics, make_producer

codec = AvroCodec()
PARTITION = 3


def request(catalog: TopicCatalog, request_id: str, created_at_ms: int) -> ChatRequest:
    return ChatRequest(request_id=request_id, model=MODEL, messages=[ChatMessage("user", "hi")], tier="standard",
                       reply_topic=catalog.tokens, reply_partition=PARTITION, created_at_ms=created_at_ms)


async def publish(sender: RecordSender, catalog: TopicCatalog, request_id: str, seqs: range) -> None:
    for seq in seqs:
        await sender.send_and_wait(catalog.tokens, TokenEvent(request_id, seq, f"{request_id}:{seq}", [seq]),
                                   request_id, partition=PARTITION)


@contextlib.asynccontextmanager
async def log_and_sender(bus) -> AsyncIterator[tuple[TokenLog, RecordSender]]:
    producer = make_producer(bus)
    await producer.start()
    log = TokenLog(bus, codec, clock_skew_ms=0)
    await log.start()
    try:
        yield log, RecordSender(producer, codec, TopicCatalog(bus))
    finally:
        await log.stop()
        await producer.stop()


async def test_later_lookups_read_on_from_the_last_scan_and_still_find_everything(bus):
    """A worker with a backlog looks its requests up in waves. A wave none of whose requests was
    in what the last scan passed reads only what was written since; one that was, or one with a
    request older than that scan, reads the log again from its oldest request."""
    catalog = TopicCatalog(bus)
    started = now_ms()
    a, b = (request(catalog, name, started) for name in ("a", "b"))
    async with log_and_sender(bus) as (log, sender):
        await publish(sender, catalog, "early", range(2))
        await asyncio.sleep(0.05)
        for request_id in ("a", "noise-1", "noise-2"):
            await publish(sender, catalog, request_id, range(2))
        first = await asyncio.gather(log.lookup(a), log.lookup(b))
        assert [e.text for e in first[0].events] == ["a:0", "a:1"] and first[1].events == []
        assert log.records_scanned == 8  # early's too: created at the same moment

        await publish(sender, catalog, "b", range(3))
        await publish(sender, catalog, "noise-3", range(2))
        read_before = log.records_scanned
        second = await log.lookup(b)
        assert [e.text for e in second.events] == ["b:0", "b:1", "b:2"]
        assert log.records_scanned - read_before == 5  # only what was written since

        read_before = log.records_scanned
        again = await log.lookup(a)  # a was passed before: its events may be anywhere
        assert [e.text for e in again.events] == ["a:0", "a:1"]
        assert log.records_scanned - read_before == 13

        older = request(catalog, "early", started - 60_000)  # older than any scan so far
        read_before = log.records_scanned
        assert [e.seq for e in (await log.lookup(older)).events] == [0, 1]
        assert log.records_scanned - read_before == 13


async def test_a_log_recreated_since_the_last_scan_is_read_again(bus):
    """A broker without storage restarted (or a topic re-created): the new log can grow past where
    the last scan ended, with other records at those offsets. The next lookup reads it all."""
    catalog = TopicCatalog(bus)
    started = now_ms()
    async with log_and_sender(bus) as (log, sender):
        await publish(sender, catalog, "before", range(3))
        assert (await log.lookup(request(catalog, "x", started))).events == []

        await delete_topics(bus.bootstrap_servers, [catalog.tokens])
        await ensure_topics(bus.bootstrap_servers, [t for t in catalog.all_topics() if t.name == catalog.tokens])
        await publish(sender, catalog, "x", range(2))
        await publish(sender, catalog, "after", range(3))  # the new log ends past the old one
        found = await log.lookup(request(catalog, "x", started))
        assert [e.text for e in found.events] == ["x:0", "x:1"]


async def test_a_log_emptied_between_listing_and_reading_is_found_empty(bus, monkeypatch):
    """A reply router deletes a rolled log, and this reader's own metadata request creates it
    again, empty, between the broker listing the log's end and the scan reading the record
    before it (seen after a broker restart). The lookup finds nothing published; it used to wait
    for that record until the scan's timeout, holding up every lookup behind it."""
    catalog = TopicCatalog(bus)
    started = now_ms()
    monkeypatch.setattr(token_log, "SCAN_TIMEOUT_S", 10.0)
    async with log_and_sender(bus) as (log, sender):
        await publish(sender, catalog, "before", range(3))
        assert (await log.lookup(request(catalog, "x", started))).events == []

        await delete_topics(bus.bootstrap_servers, [catalog.tokens])
        await ensure_topics(bus.bootstrap_servers, [t for t in catalog.all_topics() if t.name == catalog.tokens])

        async def listed_before_the_deletion(partitions):
            return {tp: 3 for tp in partitions}

        monkeypatch.setattr(log._consumer, "end_offsets", listed_before_the_deletion)
        assert (await log.lookup(request(catalog, "x", started))).events == []


async def test_a_scan_reads_the_log_as_its_first_fetch_found_it(bus, monkeypatch):
    """What is written while a scan reads (running requests' new tokens) is not read: a busy log
    grows as fast as a scan reads it. Seven records are in the log; the scan's first fetch said it
    ended after four (what it would say had the last three been written after that fetch), and
    later fetches say seven. The scan reads four; the next wave reads on from there."""
    catalog = TopicCatalog(bus)
    started = now_ms()
    async with log_and_sender(bus) as (log, sender):
        for request_id, count in (("a", 2), ("noise-1", 2), ("a-later", 3)):
            await publish(sender, catalog, request_id, range(count))
        consumer = log._consumer
        highwater = consumer.highwater
        answers = 0

        def growing(tp):
            nonlocal answers
            known = highwater(tp)
            if known is None:
                return None
            answers += 1
            return 4 if answers == 1 else known

        monkeypatch.setattr(consumer, "highwater", growing)
        found = await log.lookup(request(catalog, "a", started))
        assert [e.text for e in found.events] == ["a:0", "a:1"]
        assert log.records_scanned == 4

        monkeypatch.setattr(consumer, "highwater", highwater)
        later = await log.lookup(request(catalog, "a-later", started))  # not passed: reads on from 4
        assert [e.text for e in later.events] == ["a-later:0", "a-later:1", "a-later:2"]
        assert log.records_scanned == 7


async def test_a_wave_whose_events_precede_an_earlier_scan_is_answered_without_reading(bus):
    """A backlog's requests were served, if at all, before their partition became this worker's.
    Once a scan made after that has passed none of a wave's keys, the wave is answered without
    reading what was written since (the worker's own output). A wave with a key that scan passed
    is read; a lookup that cannot say when its events were written (a request served again) reads on."""
    catalog = TopicCatalog(bus)
    started = now_ms()
    async with log_and_sender(bus) as (log, sender):
        await publish(sender, catalog, "a", range(2))
        assigned_at = time.monotonic()
        first = await log.lookup(request(catalog, "a", started), assigned_at)
        assert [e.text for e in first.events] == ["a:0", "a:1"]
        assert log.records_scanned == 2
        for request_id in ("own-1", "own-2"):
            await publish(sender, catalog, request_id, range(3))

        assert (await log.lookup(request(catalog, "b", started), assigned_at)).events == []
        assert log.records_scanned == 2

        again = await log.lookup(request(catalog, "own-1", started))  # served again: it reads on
        assert [e.seq for e in again.events] == [0, 1, 2]
        assert log.records_scanned == 8

        passed = await log.lookup(request(catalog, "a", started), assigned_at)  # a was passed: read again
        assert [e.seq for e in passed.events] == [0, 1]
        assert log.records_scanned == 16


async def test_a_log_empty_at_the_first_wave_answers_the_next_without_reading(bus):
    """A worker starting with a backlog that nobody served: its first wave finds nothing written
    since the requests were made; the next wave, fetched after the worker has written thousands
    of its own tokens, reads none of them."""
    catalog = TopicCatalog(bus)
    started = now_ms()
    async with log_and_sender(bus) as (log, sender):
        assigned_at = time.monotonic()
        assert (await log.lookup(request(catalog, "a", started), assigned_at)).events == []
        await publish(sender, catalog, "own", range(5))
        assert (await log.lookup(request(catalog, "b", started), assigned_at)).events == []
        assert log.records_scanned == 0
        later = time.monotonic()  # a partition assigned after the worker wrote: its events may be anywhere
        assert (await log.lookup(request(catalog, "own", started), later)).events != []
        assert log.records_scanned == 5


async def test_a_wave_older_than_the_scans_so_far_reads_only_what_was_written_before_them(bus):
    """A backlog's request partitions are fetched in turns, each from its own oldest request, so a
    later wave can hold requests older than any scanned so far. It reads what was written from its
    oldest request's time up to where the earlier scan began, not the worker's output since."""
    catalog = TopicCatalog(bus)
    async with log_and_sender(bus) as (log, sender):
        old = now_ms()
        await publish(sender, catalog, "old", range(2))
        await asyncio.sleep(0.05)
        mid = now_ms()
        await publish(sender, catalog, "mid", range(2))
        assigned_at = time.monotonic()
        first = await log.lookup(request(catalog, "mid", mid), assigned_at)
        assert [e.seq for e in first.events] == [0, 1] and log.records_scanned == 2
        await publish(sender, catalog, "own", range(5))  # the worker's own output since

        older = await log.lookup(request(catalog, "old", old), assigned_at)
        assert [e.text for e in older.events] == ["old:0", "old:1"]
        assert log.records_scanned == 4  # the two before the first scan began, not the five after it

        assert (await log.lookup(request(catalog, "never-served", old), assigned_at)).events == []
        assert log.records_scanned == 4  # both scans together reach back that far: nothing to read
