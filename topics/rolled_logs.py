"""Reading every rolled reply log (topics/replies.py) as routers create them: for a reader of all
token streams, the output moderation job on the embedded broker, where a faust agent cannot
follow topics that come and go (faust subscribes to a fixed list of names).

The reader lists the broker's topics every ``DISCOVER_EVERY_S`` (and at once when the doorbell,
topics/doorbell.py, rings for a rolled log it does not read) and reads each new rolled log
from its group's committed position, or from its start (a router makes each log a rotation
before it writes to it, so the reader is there from its first record; the ring covers the logs a
router makes at its start, used at once). Positions are committed without joining
the group, so logs coming and going cause no rebalance. A log is let go once its router has moved
on (a record arrived on a newer log of the same router) and nothing arrived on it for
``LET_GO_AFTER_S``, well before its router deletes it (``keep_s``, minutes): a fetch of a deleted
log would make the embedded broker create it again. A newer log merely existing says nothing: a
router makes its next log a rotation ahead, so the log it writes now always has a newer one, and a
quiet spell would otherwise let go the log new streams still go to. One reader per stack and
group: a second one would read every log again.

With ``express`` the reader also takes the records writers hand over on the logs' express lane
(topics/doorbell.py: a light GPU consumer's every token event, output moderation's truncations),
where that is the next record of a log it reads: fetched and handed-over records are handled one
at a time, each offset once and in order, whichever copy comes first (a hand-over ahead of a gap
is left to the fetch). While the lane brings every record its fetches only back it up, at the
profile's express wait (``FetchPacer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from tokenbus.topics import doorbell
from tokenbus.topics.catalog import TopicCatalog
from tokenbus.topics.clients import cancel_task, express_lane_on, make_consumer, rewind_recreated, stop_reader
from tokenbus.topics.pacing import FetchPacer
from tokenbus.topics.settings import BusSettings

log = logging.getLogger(__name__)

# Routers make each log a rotation (at least 15 s) before they use it, and the first write to a
# log rings the doorbell. Listing every topic costs the embedded broker more as topics come and go
# (deleted ones included): 0.4 ms fresh, 14 ms after 300.
DISCOVER_EVERY_S = 5.0
COMMIT_EVERY_S = 1.0
LET_GO_AFTER_S = 60.0


class RolledLogReader:
    def __init__(self, settings: BusSettings, group_id: str, on_record: Callable[[ConsumerRecord], Awaitable[None]],
                 name: str = "rolled-logs", on_let_go: Callable[[str], None] | None = None,
                 fetch_wait_ms: int | None = None, express: bool = False) -> None:
        """``fetch_wait_ms``: the wait of its fetches while records flow, unless the profile's;
        ``express``: take hand-overs too, where the stack has an express lane."""
        self._settings = settings
        self._catalog = TopicCatalog(settings)
        self._group_id = group_id
        self._on_record = on_record
        self._on_let_go = on_let_go  # a log was let go: whatever was kept about it can go
        self._name = name
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._express_lane = express and express_lane_on(settings)
        self._pacer = FetchPacer(settings, busy_wait_ms=fetch_wait_ms, on_ring=self._rung, express=self._express_lane)
        self._express: asyncio.Task[None] | None = None  # listens on the lane
        self._handed: asyncio.Queue[ConsumerRecord] = asyncio.Queue()  # handed over, to be taken in turn
        self._taking: asyncio.Task[None] | None = None
        self._handling = asyncio.Lock()  # one record at a time, fetched or handed over
        self._unread_log_rung = asyncio.Event()  # a writer rang for a rolled log this reader does not read
        self._positions: dict[TopicPartition, int] = {}  # the logs read now: next offset to handle
        self._last_record: dict[str, float] = {}  # log -> when a record last arrived on it (or it was found)
        self._written: set[str] = set()  # logs a record arrived on: their routers have moved to them
        self._let_go: set[str] = set()  # logs done with that the broker still lists
        self._committed: dict[TopicPartition, int] = {}

    @property
    def reading(self) -> list[str]:
        return sorted(tp.topic for tp in self._positions)

    async def start(self) -> None:
        self._consumer = make_consumer(self._settings, group_id=self._group_id)
        await self._consumer.start()
        self._pacer.attach(self._consumer)  # which gives it the pacer's fetch wait
        await self._discover()
        self._task = asyncio.create_task(self._read(), name=self._name)
        if self._express_lane:
            assert self._settings.doorbell_url
            self._taking = asyncio.create_task(self._take_handed_over(), name=f"{self._name}-express")
            self._express = asyncio.create_task(doorbell.listen_express(
                self._settings.doorbell_url, self._catalog.tokens + ".", self._handed_over), name=f"{self._name}-lane")

    async def stop(self) -> None:
        await self._pacer.close()
        await cancel_task(self._express)
        await cancel_task(self._taking)
        if self._consumer is not None and self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            await self._commit()
        await stop_reader(self._task, self._consumer)

    async def _read(self) -> None:
        assert self._consumer is not None
        loop = asyncio.get_running_loop()
        discover_at = commit_at = loop.time()
        while True:
            if loop.time() >= discover_at or self._unread_log_rung.is_set():
                self._unread_log_rung.clear()
                discover_at = loop.time() + DISCOVER_EVERY_S
                try:
                    await self._discover()
                except KafkaError as exc:  # the broker is away: look again next time
                    log.warning("%s: listing topics failed (%s)", self._name, type(exc).__name__)
                for tp in await rewind_recreated(self._consumer):
                    self._positions[tp] = 0
            if not self._positions:  # no log yet: aiokafka's getmany would wait for an assignment for ever
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, discover_at - loop.time())):
                        await self._unread_log_rung.wait()
                continue
            batches = await self._consumer.getmany(timeout_ms=500)
            self._pacer.observed_by_topic(batches)  # a log made ahead, or retired, is paused while quiet
            watching_lane = self._pacer.watching_lane
            async with self._handling:
                for tp, records in batches.items():
                    if tp not in self._positions:
                        continue  # let go meanwhile
                    self._last_record[tp.topic] = time.monotonic()
                    self._written.add(tp.topic)
                    for record in records:
                        if record.offset < self._positions[tp]:
                            continue  # handed over already
                        if watching_lane:
                            self._pacer.fetched_first(tp.topic, tp.partition, record.offset)
                        await self._on_record(record)
                        self._positions[tp] = record.offset + 1
            if self._express_lane:
                self._pacer.serving(None)  # it reads every writer's streams: the lane alone says how long to wait
            if loop.time() >= commit_at:
                commit_at = loop.time() + COMMIT_EVERY_S
                await self._commit()

    def _handed_over(self, handed: doorbell.Handed) -> None:
        self._pacer.handed_over(handed.topic, handed.partition, handed.offset)
        position = self._positions.get(TopicPartition(handed.topic, handed.partition))
        if position is not None and position <= handed.offset:  # a log it reads, not fetched that far yet
            key, value = handed.key, handed.value
            self._handed.put_nowait(ConsumerRecord(
                handed.topic, handed.partition, handed.offset, timestamp=-1, timestamp_type=0, key=key, value=value,
                checksum=None, serialized_key_size=-1 if key is None else len(key),
                serialized_value_size=len(value), headers=()))  # the lane carries no timestamp, and no headers

    async def _take_handed_over(self) -> None:
        """Handle each handed-over record that is the next of its log, in the order they came."""
        while True:
            record = await self._handed.get()
            tp = TopicPartition(record.topic, record.partition)
            async with self._handling:
                if self._positions.get(tp) != record.offset:  # fetched meanwhile, a log let go, or one ahead of a gap
                    continue
                await self._on_record(record)
                if tp in self._positions:
                    self._positions[tp] = record.offset + 1

    def _rung(self, topic: str) -> None:
        if (self._catalog.parse_rolled_reply_log(topic) is not None and topic not in self._let_go
                and TopicPartition(topic, 0) not in self._positions):
            self._unread_log_rung.set()

    async def _discover(self) -> None:
        """Start reading rolled logs that appeared, let go of those done with."""
        assert self._consumer is not None
        listed = {name for name in await self._consumer.topics()  # every topic: a listing creates none
                  if self._catalog.parse_rolled_reply_log(name) is not None}
        self._let_go &= listed
        self._written &= listed
        changed = False
        for name in sorted(listed - self._let_go - {tp.topic for tp in self._positions}):
            tp = TopicPartition(name, 0)
            self._positions[tp] = await self._consumer.committed(tp) or 0
            self._last_record[name] = time.monotonic()
            changed = True
        done = [tp for tp in self._positions if tp.topic not in listed or self._done_with(tp.topic, listed)]
        if done:
            await self._commit()  # where each log was left, for a reader of the same group later
        for tp in done:
            del self._positions[tp]
            self._committed.pop(tp, None)
            self._last_record.pop(tp.topic, None)
            self._let_go.add(tp.topic)
            if self._on_let_go is not None:
                self._on_let_go(tp.topic)
            changed = True
        if changed:
            self._consumer.assign(list(self._positions))
            for tp, position in self._positions.items():
                self._consumer.seek(tp, position)

    def _done_with(self, name: str, listed: set[str]) -> bool:
        """Its router writes a newer log, and nothing arrived on this one lately."""
        owner, created_ms = self._catalog.parse_rolled_reply_log(name) or ("", 0)
        written = (self._catalog.parse_rolled_reply_log(other) for other in listed & self._written)
        moved_on = any(r is not None and r[0] == owner and r[1] > created_ms for r in written)
        return moved_on and time.monotonic() - self._last_record.get(name, 0.0) >= LET_GO_AFTER_S

    async def _commit(self) -> None:
        assert self._consumer is not None
        moved = {tp: OffsetAndMetadata(p, "") for tp, p in self._positions.items() if self._committed.get(tp) != p}
        if not moved:
            return
        try:
            await self._consumer.commit(moved)
        except Exception as exc:  # the broker is away: the next commit carries the positions
            log.warning("%s: commit failed (%s)", self._name, type(exc).__name__)
            return
        self._committed.update({tp: meta.offset for tp, meta in moved.items()})
