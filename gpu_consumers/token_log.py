"""Read back what was already published for requests: the basis of crash takeover.

When a request is redelivered (its worker died, or its partition moved), the tokens
the previous worker published are in the log. The new worker reads them and either
continues the generation after them (``seq`` continuing) or, if the request had
finished, only re-publishes its Completion (consumers of `completions` dedup by id).

Lookups are batched: one scan of a reply partition answers every request waiting
on it. A scan starts at the first record written since the oldest request was
created (``offsets_for_times``, with a margin for clock skew between machines).
A worker that starts with a backlog looks its requests up in waves, as it fetches
them, all created before it started: each scan remembers the keys it passed
(``_Scanned``), so that the next wave, when none of its requests was among them,
reads on from where the last scan ended rather than from the backlog's start again.

A lookup may say when everything it needs was written by: a backlog request's earlier tokens
were written by its partition's previous owner, which flushes before the partition moves
(or crashed), so all of them precede the partition's assignment to this worker. A wave whose
requests' tokens all precede a scan already made, and none of whose keys that scan passed, is
answered without reading at all: what a busy worker wrote since is its own output. A wave
holding requests older than any scanned so far (a backlog's request partitions are fetched in
turns, each from its own oldest) reads only what was written before that scan began, back to its
own oldest request, not the worker's output since again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from tokenbus.schemas import AvroCodec, ChatRequest, DecodeError, TokenEvent
from tokenbus.topics import BusSettings, make_consumer, stop_reader

log = logging.getLogger(__name__)

SCAN_TIMEOUT_S = 30.0
SCANNED_KEYS = 50_000  # keys an earlier scan of a partition remembers at most (~5 MB)
SCANNED_FOR_S = 60.0  # and for how long after its last use


@dataclass
class Published:
    """A request's token events already in the log, contiguous from seq 0."""

    events: list[TokenEvent] = field(default_factory=list)

    @property
    def next_seq(self) -> int:
        return len(self.events)

    @property
    def text(self) -> str:
        """What the engine generated so far (tool-call markup included): a takeover continues after it."""
        return "".join(e.text if e.raw_text is None else e.raw_text for e in self.events)

    @property
    def tool_calls(self) -> int:
        """Function calls already delivered: a takeover numbers its calls after them."""
        return sum(1 for e in self.events for d in e.tool_calls if d.id is not None)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for e in self.events for t in e.token_ids)

    @property
    def final(self) -> TokenEvent | None:
        return self.events[-1] if self.events and self.events[-1].is_final else None

    @classmethod
    def contiguous(cls, by_seq: dict[int, TokenEvent]) -> Published:
        events: list[TokenEvent] = []
        while len(events) in by_seq:
            events.append(by_seq[len(events)])
            if events[-1].is_final:
                break
        return cls(events)


@dataclass
class _Scanned:
    """What the scans of one reply partition have passed: every key from the first record written
    since ``since_ms`` up to offset ``end``. A request created after ``since_ms`` (less the skew
    margin) whose key is not among them has no event before ``end``."""

    since_ms: int
    first: int | None  # the first offset read: written at or after ``since_ms`` (None: nothing was)
    end: int | None  # None: nothing was written since ``since_ms`` when it was looked at
    keys: set[bytes]
    last: tuple[bytes, int] | None  # the key and timestamp of the record at end - 1: the same log still?
    used_at: float
    as_of: float  # monotonic time: every record written before it lies before ``end``

    def covers(self, since_ms: int, keys: list[bytes]) -> bool:
        return (since_ms >= self.since_ms and time.monotonic() - self.used_at < SCANNED_FOR_S
                and not any(k in self.keys for k in keys))

    def answers(self, since_ms: int, keys: list[bytes], written_before: float | None) -> bool:
        """Whether requests whose events were all written before ``written_before`` are known to
        have none: everything written since ``since_ms`` up to then was scanned, their keys not in it."""
        return written_before is not None and written_before <= self.as_of and self.covers(since_ms, keys)

    def answers_from(self, since_ms: int, keys: list[bytes], written_before: float | None) -> bool:
        """Whether the same holds but for what was written between ``since_ms`` and this scan's
        ``since_ms``: the records before ``first``, which is all such requests need read."""
        return (written_before is not None and written_before <= self.as_of and since_ms < self.since_ms
                and self.covers(self.since_ms, keys))


class TokenLog:
    def __init__(self, settings: BusSettings, codec: AvroCodec, clock_skew_ms: int = 2000) -> None:
        self._settings = settings
        self._codec = codec
        self._clock_skew_ms = clock_skew_ms
        self._scanned: dict[TopicPartition, _Scanned] = {}
        self.records_scanned = 0  # records read by scans, all told
        self._lookups: asyncio.Queue[tuple[ChatRequest, float | None, asyncio.Future[Published]]] = asyncio.Queue()
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._consumer = make_consumer(self._settings)
        await self._consumer.start()
        self._task = asyncio.create_task(self._serve_lookups(), name="token-log")

    async def stop(self) -> None:
        await stop_reader(self._task, self._consumer)

    def lookup(self, request: ChatRequest, written_before: float | None = None) -> asyncio.Future[Published]:
        """What the log holds of ``request``'s events, as a future with no task of its own (a
        backlog's requests are looked up as they are fetched, hundreds at once); cancelling it
        withdraws the lookup. ``written_before`` (``time.monotonic()``): when every event wanted
        had been written by, if known (None: they may have been written until now)."""
        future: asyncio.Future[Published] = asyncio.get_running_loop().create_future()
        self._lookups.put_nowait((request, written_before, future))
        return future

    async def _serve_lookups(self) -> None:
        while True:
            batch = [await self._lookups.get()]
            while not self._lookups.empty():
                batch.append(self._lookups.get_nowait())
            by_partition: dict[TopicPartition, list[tuple[ChatRequest, float | None, asyncio.Future[Published]]]]
            by_partition = defaultdict(list)
            for request, written_before, future in batch:
                by_partition[TopicPartition(request.reply_topic, request.reply_partition)].append(
                    (request, written_before, future))
            for tp, items in by_partition.items():
                bounds = [written_before for _, written_before, _ in items]
                written_before = None if None in bounds else max(b for b in bounds if b is not None)
                try:
                    started = time.monotonic()
                    async with asyncio.timeout(SCAN_TIMEOUT_S):  # wait_for can swallow a cancellation on 3.11
                        found = await self._scan(tp, [request for request, _, _ in items], written_before)
                    log.info("token log scan of %s-%s for %d requests: %.0f ms", tp.topic, tp.partition, len(items),
                             (time.monotonic() - started) * 1000)
                except Exception as exc:  # the lookups fail; their requests are redelivered later
                    for _, _, future in items:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for request, _, future in items:
                    if not future.done():
                        future.set_result(found.get(request.request_id, Published()))

    async def _scan(self, tp: TopicPartition, requests: list[ChatRequest],
                    written_before: float | None = None) -> dict[str, Published]:
        consumer = self._consumer
        assert consumer is not None
        as_of = time.monotonic()  # whatever was written before now, this scan reads (or finds absent)
        since = max(0, min(r.created_at_ms for r in requests) - self._clock_skew_ms)
        wanted = {r.request_id.encode(): r.request_id for r in requests}
        scanned = self._scanned.get(tp)
        if scanned is not None and scanned.answers(since, list(wanted), written_before):
            scanned.used_at = as_of
            return {}  # all of their events would be in what was scanned before, and none is
        consumer.assign([tp])
        self._scanned.pop(tp, None)  # replaced below by what this scan reads
        try:
            if scanned is not None and scanned.answers_from(since, list(wanted), written_before):
                return await self._scan_before(tp, scanned, since, wanted)
            if (scanned is not None and scanned.end is not None and scanned.last is not None
                    and scanned.covers(since, list(wanted))
                    and (await consumer.end_offsets([tp]))[tp] >= scanned.end  # the same log still, not one
                    and scanned.last == await self._key_and_time_at(tp, scanned.end - 1)):  # re-created since
                start: int | None = scanned.end  # none of them is in what was scanned before
            else:
                scanned, start = None, await self._first_offset_since(tp, since)
            if start is None:  # nothing written since the requests were made
                self._scanned[tp] = _Scanned(since, None, None, set(), None, as_of, as_of)
                return {}
            # The scan reads to the log end its first fetch finds, not on to an end that moves: what a
            # request has from before (its previous owner's tokens, or this worker's own before its
            # serving failed) is durable by then, as a worker flushes before its partitions move; what
            # comes after is new output of running requests, which a busy log adds while the scan reads.
            found, passed, last, end = await self._read(tp, start, None, wanted)
            if scanned is not None:
                passed |= scanned.keys
            last = last or (scanned.last if scanned is not None else None)
            if last is not None and len(passed) <= SCANNED_KEYS:
                self._scanned[tp] = _Scanned(scanned.since_ms if scanned else since,
                                             scanned.first if scanned else start, end, passed, last,
                                             time.monotonic(), as_of)
            return found
        finally:
            consumer.assign([])  # an assigned partition would be fetched in the background forever

    async def _scan_before(self, tp: TopicPartition, scanned: _Scanned, since: int,
                           wanted: dict[bytes, str]) -> dict[str, Published]:
        """Requests older than what ``scanned`` reached back to, whose events all precede it: read
        from the first record since ``since`` up to where ``scanned`` began, and remember the two as one."""
        start = await self._first_offset_since(tp, since)
        # Where ``scanned`` began; if it found nothing, whatever is at or after its ``since_ms``
        # now was written after it looked, and is not wanted.
        stop = scanned.first if scanned.first is not None else await self._first_offset_since(tp, scanned.since_ms)
        found: dict[str, Published] = {}
        passed: set[bytes] = set()
        if start is not None and (stop is None or start < stop):
            found, passed, _, _ = await self._read(tp, start, stop, wanted)
        keys = scanned.keys | passed
        if len(keys) <= SCANNED_KEYS:
            self._scanned[tp] = dataclasses.replace(scanned, since_ms=since, keys=keys, used_at=time.monotonic(),
                                                    first=start if start is not None else scanned.first)
        return found

    async def _read(self, tp: TopicPartition, start: int, stop: int | None, wanted: dict[bytes, str]
                    ) -> tuple[dict[str, Published], set[bytes], tuple[bytes, int] | None, int]:
        """Read ``tp`` (assigned) from ``start`` up to ``stop``, or to the log end its first fetch finds:
        the events of the ``wanted`` keys, every key passed, the key and time of the last record read,
        and where the read ended. The fetch's high-water mark, not ``end_offsets``, which the
        embedded broker answers with the last batch's first offset + 1."""
        consumer = self._consumer
        assert consumer is not None
        consumer.seek(tp, start)
        passed: set[bytes] = set()
        last: tuple[bytes, int] | None = None
        by_request: dict[str, dict[int, TokenEvent]] = defaultdict(dict)
        log_end = stop
        while True:
            records = (await consumer.getmany(tp, timeout_ms=200)).get(tp, [])
            if log_end is None:
                log_end = consumer.highwater(tp)
            for record in records:
                if log_end is not None and record.offset >= log_end:
                    break
                last = (record.key or b"", record.timestamp)
                self.records_scanned += 1
                if len(passed) <= SCANNED_KEYS:  # past that, this scan is not remembered
                    passed.add(record.key or b"")
                request_id = wanted.get(record.key or b"")
                if request_id is None:
                    continue
                try:
                    event = self._codec.decode(record.value, TokenEvent)
                except DecodeError:
                    continue
                by_request[request_id].setdefault(event.seq, event)
            position, highwater = await consumer.position(tp), consumer.highwater(tp)
            if (log_end is not None and position >= log_end) or (highwater is not None and position >= highwater):
                break
        end = position if log_end is None else min(position, log_end)
        found = {request_id: Published.contiguous(events) for request_id, events in by_request.items()}
        return found, passed, last, end

    async def _first_offset_since(self, tp: TopicPartition, since_ms: int) -> int | None:
        """The first offset of ``tp`` written at or after ``since_ms``, or None if every record is
        older: the broker's time index answers (``offsets_for_times``; the embedded broker says
        "none" as offset 0 with timestamp -1, where Kafka says None). Not every Kafka-protocol
        broker keeps a time index (librdkafka's mock cluster answers None whatever the time), so
        a None is trusted only if the log's last record is older; otherwise the offsets are
        searched by timestamp, a record per step. Timestamps are the producers' clocks, not
        strictly ordered: the clock-skew margin covers that too."""
        consumer = self._consumer
        assert consumer is not None
        found = (await consumer.offsets_for_times({tp: since_ms})).get(tp)
        if found is not None and found.timestamp >= 0:
            return int(found.offset)
        low = (await consumer.beginning_offsets([tp]))[tp]
        high = (await consumer.end_offsets([tp]))[tp]
        if high <= low or await self._older(tp, high - 1, since_ms):
            return None
        while low < high - 1:  # the record at high - 1 is at or after since_ms
            middle = (low + high - 1) // 2
            if await self._older(tp, middle, since_ms):
                low = middle + 1
            else:
                high = middle + 1
        return int(low)

    async def _older(self, tp: TopicPartition, offset: int, since_ms: int) -> bool:
        """Whether the first record at or after ``offset`` was written before ``since_ms``. With no
        record there (the log was re-created shorter meanwhile) it is not: the scan starts earlier,
        which costs time, where starting too late would miss what was published."""
        found = await self._key_and_time_at(tp, offset)
        return found is not None and found[1] < since_ms

    async def _key_and_time_at(self, tp: TopicPartition, offset: int) -> tuple[bytes, int] | None:
        """The key and timestamp of the first record at or after ``offset`` (``tp`` is assigned);
        None if the log ends before it, as a fetch answered after the seek says. The offsets
        the broker lists are not trusted for that: the embedded broker's log end is the last
        batch's first offset + 1, and a log re-created since it was listed may be shorter."""
        consumer = self._consumer
        assert consumer is not None
        consumer.seek(tp, offset)
        sought_ms = int(time.time() * 1000)
        while True:
            records = (await consumer.getmany(tp, timeout_ms=200, max_records=1)).get(tp, [])
            if records:
                return records[0].key or b"", int(records[0].timestamp)
            highwater, answered_ms = consumer.highwater(tp), consumer.last_poll_timestamp(tp)
            if highwater is not None and highwater <= offset and answered_ms is not None and answered_ms >= sought_ms:
                return None
