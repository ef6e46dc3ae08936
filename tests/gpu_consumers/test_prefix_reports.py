"""The worker's cache reports: what a leaving worker tells routers (on the real broker), and which
prefixes a report checks."""

import asyncio
import zlib

from aiokafka import TopicPartition

from tests.conftest import MODEL
from tests.gpu_consumers.helpers import read_all
from tokenbus.gpu_consumers.engines import GenerationInput, PromptLayout
from tokenbus.gpu_consumers.engines.simulated_prompts import PrefixCacheModel
from tokenbus.gpu_consumers.prefix_reports import CHECKS_PER_REPORT, EVICTION_CHECK_S, PrefixReports
from tokenbus.schemas import AvroCodec, CacheReport, ChatMessage, ChatRequest
from tokenbus.schemas.prefixes import segment_hashes
from tokenbus.topics import RecordSender, TopicCatalog, make_producer

codec = AvroCodec()


async def test_stopping_right_after_a_change_still_reports_leaving(bus):
    """A worker giving its partitions back marks the reports changed and stops them at once. On
    Python 3.11, ``asyncio.wait_for`` returned the event's result and swallowed the cancellation
    when both landed in one loop pass, so ``stop()`` waited for ever and the worker never left."""
    catalog = TopicCatalog(bus)
    producer = make_producer(bus)
    await producer.start()
    try:
        reports = PrefixReports(PrefixCacheModel(4096, 16), RecordSender(producer, codec, catalog), "w-leaving", MODEL,
                                lambda: (0, 0), report_interval_ms=10, snapshot_interval_s=60)
        reports.start()
        await asyncio.sleep(0.1)  # the first snapshot is out; the task waits for a change
        reports.owned({TopicPartition(catalog.requests(MODEL, "standard"), 0)})
        async with asyncio.timeout(10):
            await reports.stop()
    finally:
        await producer.stop()

    # The first snapshot, maybe the change's report (if it went out before the stop), then the leaving one.
    records = await read_all(bus, catalog.cache_reports,
                             until=lambda got: any(codec.decode(r.value, CacheReport).leaving for r in got))
    last = codec.decode(records[-1].value, CacheReport)
    assert last.worker_id == "w-leaving" and last.leaving and last.partitions == []


class BlocksCache:
    """A prefix cache whose held blocks the test sets, counting the blocks each check asks about:
    each message of a prompt is a block, named by the message's text."""

    block_tokens = 16

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.asked: list[int] = []
        self.laid_out: list[GenerationInput] = []

    def layout(self, inp: GenerationInput) -> PromptLayout:
        self.laid_out.append(inp)
        blocks = tuple(zlib.crc32(m.content.encode()) for m in inp.messages)
        return PromptLayout(self.block_tokens, blocks, tuple(16 * (i + 1) for i in range(len(blocks))))

    def resident(self, block_hashes) -> set[int]:
        asked = set(block_hashes)
        self.asked.append(len(asked))
        return asked & self.held


def conversation(i: int) -> ChatRequest:
    return ChatRequest(f"r{i}", MODEL, "standard", [ChatMessage("system", "s"), ChatMessage("user", f"u{i}")], "tokens", 0)


def block(text: str) -> int:
    return zlib.crc32(text.encode())


class FakeClock:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.now = loop.time()

    def __call__(self) -> float:
        return self.now


async def test_a_busy_worker_checks_its_new_prefixes_and_a_share_of_the_rest_at_each_report(monkeypatch):
    """At each report the prefixes admitted lately are checked until the engine holds them, and a
    share of all the others in turn, so that each is checked at least every ``EVICTION_CHECK_S``:
    an eviction is reported within that time, without checking every prefix watched (20,000 on a
    busy worker) ten times a second."""
    clock = FakeClock(asyncio.get_running_loop())
    monkeypatch.setattr(asyncio.get_running_loop(), "time", clock)
    cache = BlocksCache()
    busy = lambda: (200, 50)  # noqa: E731  (running, waiting)
    reports = PrefixReports(cache, None, "w", MODEL, busy, report_interval_ms=100, snapshot_interval_s=60)
    for i in range(5000):
        reports.admitted(conversation(i))
    cache.held = {block("s")} | {block(f"u{i}") for i in range(5000)}
    stored, removed = reports.check(everything=True)
    assert len(stored) == 5001 and not removed  # the shared system prompt once, each conversation once

    cache.held -= {block("u7"), block("u4990")}  # evicted: one checked early in a round, one late
    cache.asked.clear()
    reports.admitted(conversation(5000))  # new, not held yet
    found_removed, found_stored = [], {}
    for report in range(int(EVICTION_CHECK_S / 0.1)):  # a report every 100 ms for EVICTION_CHECK_S
        clock.now += 0.1
        stored, removed = reports.check()
        found_removed += removed
        found_stored.update((p.hash, report) for p in stored)
        if report == 3:
            cache.held.add(block("u5000"))  # its prefill done
    assert sorted(found_removed) == sorted(segment_hashes(conversation(i))[1] for i in (7, 4990))
    assert found_stored == {segment_hashes(conversation(5000))[1]: 4}  # at the first report after it is held
    assert max(cache.asked) <= CHECKS_PER_REPORT + 2  # a share and the new one at each report, never all 5,002


async def test_a_request_is_laid_out_from_the_input_the_engine_was_given():
    """So an engine that named the prompt's blocks when it admitted it need not name them again;
    without one, from the request."""
    cache = BlocksCache()
    reports = PrefixReports(cache, None, "w", MODEL, lambda: (0, 0), report_interval_ms=100, snapshot_interval_s=60)
    given = GenerationInput.from_request(conversation(0))
    reports.admitted(conversation(0), given)
    reports.admitted(conversation(1))
    assert cache.laid_out[0] is given
    assert cache.laid_out[1] == GenerationInput.from_request(conversation(1))
    assert reports.watched == 3  # the shared system prompt, and each conversation


async def test_a_prefix_no_longer_watched_is_reported_removed(monkeypatch):
    monkeypatch.setattr("tokenbus.gpu_consumers.prefix_reports.TRACKED_PREFIXES", 2)
    cache = BlocksCache()
    reports = PrefixReports(cache, None, "w", MODEL, lambda: (0, 0), report_interval_ms=100, snapshot_interval_s=60)
    reports.admitted(conversation(0))
    cache.held = {block("s"), block("u0"), block("u1")}
    assert len(reports.check(everything=True)[0]) == 2
    reports.admitted(conversation(1))  # three prefixes (the system prompt is shared): the oldest goes
    stored, removed = reports.check(everything=True)
    assert removed == [segment_hashes(conversation(0))[1]]
    assert [p.hash for p in stored] == [segment_hashes(conversation(1))[1]]


async def test_an_idle_worker_looks_its_prefixes_over_once_then_not_until_something_runs(monkeypatch):
    """An engine lets blocks go only to make room: once nothing has run for ``EVICTION_CHECK_S``,
    one last look at every prefix, then none until a request runs again."""
    clock = FakeClock(asyncio.get_running_loop())
    monkeypatch.setattr(asyncio.get_running_loop(), "time", clock)
    cache, load = BlocksCache(), [(1, 0)]
    reports = PrefixReports(cache, None, "w", MODEL, lambda: load[0], report_interval_ms=100, snapshot_interval_s=60)
    for i in range(3000):
        reports.admitted(conversation(i))
    cache.held = {block("s")} | {block(f"u{i}") for i in range(3000)}
    assert len(reports.check(everything=True)[0]) == 3001
    load[0] = (0, 0)  # the last request finished
    cache.held.discard(block("u5"))  # let go as it finished
    cache.asked.clear()
    removed = []
    for _ in range(int(3 * EVICTION_CHECK_S)):  # an idle report loop wakes every EVICTION_CHECK_S ...
        clock.now += 0.5  # ... or sooner, here
        removed += reports.check()[1]
    assert removed == [segment_hashes(conversation(5))[1]]
    assert cache.asked[-1] == 3001  # the last look took in all of them ...
    looked = len(cache.asked)
    for _ in range(10):
        clock.now += EVICTION_CHECK_S
        reports.check()
        reports.check(everything=True)  # a snapshot's
    assert len(cache.asked) == looked  # ... and none since
    load[0] = (1, 0)  # a request runs: checks resume
    reports.check()
    assert len(cache.asked) == looked + 1
