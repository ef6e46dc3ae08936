"""Telling routers what this worker's engine holds in its prefix cache (KV-cache-aware routing).

Routers name a prompt's prefixes by chain hashes of its segments (schemas/prefixes.py); engines
hold blocks of tokens. For each request it admits, the worker asks the engine where the request's
segments end in its prompt and which block holds the end of each: a prefix counts as cached while
that block is held (engines evict a prefix's last blocks first). After admissions the worker checks
the new prefixes' blocks (until the engine holds them), and the others in turn, ``CHECKS_PER_REPORT``
of them at each report or more, so that each prefix watched is checked at least every
``EVICTION_CHECK_S`` while requests run (a busy worker watches 20,000: checking them all at every
report cost 23 ms on a slow machine, ten times a second), and once more when it has been idle that
long. It publishes what changed on ``kvcache`` as a CacheReport, with the request partitions it
owns and its load; a full snapshot goes out when the partitions change and every
``cache_snapshot_interval_s``, so a router that starts late or missed a report catches up, and a
snapshot is also the worker's heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Callable

from aiokafka import TopicPartition

from tokenbus.gpu_consumers.engines import GenerationInput, PrefixCache
from tokenbus.schemas import CachedPrefix, CacheReport, ChatRequest, now_ms
from tokenbus.schemas.prefixes import segment_hashes
from tokenbus.topics import RecordSender, cancel_task

log = logging.getLogger(__name__)

TRACKED_PREFIXES = 20_000  # prefixes watched at once; the least recently admitted are forgotten
SNAPSHOT_CHUNK = 5_000  # prefixes per record of a snapshot, to keep records small
EVICTION_CHECK_S = 2.0  # each prefix watched is checked this often, and a new one at every report for this long
CHECKS_PER_REPORT = 1_000  # prefixes a report checks at the least (every one while fewer are watched): ~1 ms


class PrefixReports:
    def __init__(self, cache: PrefixCache, sender: RecordSender, worker_id: str, model: str,
                 load: Callable[[], tuple[int, int]], report_interval_ms: int, snapshot_interval_s: float) -> None:
        self._cache = cache
        self._sender = sender
        self._worker_id = worker_id
        self._model = model
        self._load = load  # (running, waiting)
        self._report_interval = report_interval_ms / 1000
        self._snapshot_interval = snapshot_interval_s
        self._started_at_ms = now_ms()
        self._seq = 0
        self._tracked: OrderedDict[int, tuple[int, int]] = OrderedDict()  # prefix -> (its last block, tokens)
        self._held: dict[int, int] = {}  # prefix -> tokens, as last reported
        self._fresh: dict[int, float] = {}  # prefix admitted lately -> until when it is checked at every report
        self._forgotten: list[int] = []  # held prefixes no longer watched: reported removed
        self._rotation: list[int] = []  # this round of checks through the prefixes watched ...
        self._rotation_next = 0  # ... and where it stands
        self._checked_at: float | None = None
        self._quiet_since: float | None = None  # since when nothing ran or waited, while so
        self._settled = False  # all checked once nothing ran for EVICTION_CHECK_S: nothing to check until something runs
        self._partitions: list[tuple[str, int]] = []
        self._last_load: tuple[int, int] | None = None
        self._changed = asyncio.Event()
        self._snapshot_due = True
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="prefix-reports")

    async def stop(self) -> None:
        """Tell routers to send nothing more here (the worker is leaving the group)."""
        await cancel_task(self._task)
        self._task = None
        try:
            await self._send(self._report(snapshot=True, leaving=True))
        except Exception as exc:  # the broker is gone too; routers age this worker out
            log.warning("could not report leaving: %s", exc)

    def admitted(self, request: ChatRequest, inp: GenerationInput | None = None) -> None:
        """Watch the prefixes of a request the engine is about to prefill; ``inp``: what the engine
        was given for it (made from ``request`` if not given), whose layout an engine may have
        worked out already."""
        try:
            layout = self._cache.layout(inp if inp is not None else GenerationInput.from_request(request))
        except Exception:  # a prompt the engine cannot render fails in the engine, where it is reported
            return
        block = layout.block_tokens
        fresh_until = asyncio.get_running_loop().time() + EVICTION_CHECK_S
        for prefix, end in zip(segment_hashes(request), layout.segment_ends, strict=False):
            full_blocks = min(end // block, len(layout.block_hashes))
            if full_blocks:
                self._tracked[prefix] = (layout.block_hashes[full_blocks - 1], full_blocks * block)
                self._tracked.move_to_end(prefix)
                self._fresh[prefix] = fresh_until
        while len(self._tracked) > TRACKED_PREFIXES:
            prefix, _ = self._tracked.popitem(last=False)
            self._fresh.pop(prefix, None)
            if self._held.pop(prefix, None) is not None:
                self._forgotten.append(prefix)
        self._changed.set()

    @property
    def watched(self) -> int:
        """How many prefixes are watched now."""
        return len(self._tracked)

    def load_changed(self) -> None:
        """A request was fetched or finished: routers weigh load, so it is reported (at the bounded rate)."""
        self._changed.set()

    def owned(self, partitions: set[TopicPartition]) -> None:
        self._partitions = sorted((tp.topic, tp.partition) for tp in partitions)
        self._snapshot_due = True
        self._changed.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        snapshot_at = loop.time()
        while True:
            try:  # not wait_for: on 3.11 it swallows a cancellation that lands as the event is set
                async with asyncio.timeout(max(0.0, min(EVICTION_CHECK_S, snapshot_at - loop.time()))):
                    await self._changed.wait()
            except TimeoutError:
                pass
            self._changed.clear()
            if loop.time() >= snapshot_at:
                self._snapshot_due = True
            snapshot = self._snapshot_due
            try:
                await self._report_changes()
            except Exception as exc:  # a broker away: the next snapshot repairs what routers missed
                log.warning("prefix report failed: %s", exc)
                self._snapshot_due = True
            if snapshot:
                snapshot_at = loop.time() + self._snapshot_interval
            await asyncio.sleep(self._report_interval)  # bounds the rate of reports

    async def _report_changes(self) -> None:
        stored, removed = self.check(everything=self._snapshot_due)
        load = self._load()
        if self._snapshot_due:
            self._snapshot_due = False
            await self._send_snapshot()
        elif stored or removed or load != self._last_load:
            await self._send(self._report(stored=stored, removed=removed))
        self._last_load = load

    def check(self, everything: bool = False) -> tuple[list[CachedPrefix], list[int]]:
        """Which watched prefixes the engine now holds and which it let go since they were last
        checked: the new ones not yet held, and the next share of a round through all of them
        (``CHECKS_PER_REPORT``, or as much of the round as the time since the last check is of
        ``EVICTION_CHECK_S``, if more); ``everything`` for a snapshot. Once nothing has run or
        waited for ``EVICTION_CHECK_S`` (an engine lets blocks go only to make room), all are
        checked once more and then none until something runs: an idle worker that served
        thousands of conversations does not look them over every two seconds."""
        now = asyncio.get_running_loop().time()
        if self._fresh or self._load() != (0, 0):
            self._quiet_since, self._settled = None, False
        elif self._quiet_since is None:
            self._quiet_since = now
        elif self._settled:
            removed, self._forgotten = self._forgotten, []
            return [], removed
        elif now - self._quiet_since >= EVICTION_CHECK_S:
            everything = self._settled = True
        elapsed = math.inf if everything or self._checked_at is None else now - self._checked_at
        self._checked_at = now
        due = dict.fromkeys(self._fresh)
        share = min(len(self._tracked), max(CHECKS_PER_REPORT,
                                            math.ceil(len(self._tracked) * min(1.0, elapsed / EVICTION_CHECK_S))))
        while share > 0:
            if self._rotation_next >= len(self._rotation):
                self._rotation, self._rotation_next = list(self._tracked), 0
            taken = self._rotation[self._rotation_next:self._rotation_next + share]
            self._rotation_next += len(taken)
            share -= len(taken)
            due.update(dict.fromkeys(taken))
        watched = {prefix: self._tracked[prefix] for prefix in due if prefix in self._tracked}
        resident = self._cache.resident({block for block, _ in watched.values()})
        stored: list[CachedPrefix] = []
        removed, self._forgotten = self._forgotten, []
        for prefix, (block, tokens) in watched.items():
            if block in resident:
                self._fresh.pop(prefix, None)
                if self._held.get(prefix) != tokens:
                    self._held[prefix] = tokens
                    stored.append(CachedPrefix(prefix, tokens))
            elif self._held.pop(prefix, None) is not None:
                removed.append(prefix)
        for prefix in [p for p, until in self._fresh.items() if until <= now]:
            del self._fresh[prefix]
        return stored, removed

    async def _send_snapshot(self) -> None:
        held = [CachedPrefix(p, t) for p, t in self._held.items()]
        chunks = [held[i:i + SNAPSHOT_CHUNK] for i in range(0, len(held), SNAPSHOT_CHUNK)] or [[]]
        for i, chunk in enumerate(chunks):
            await self._send(self._report(snapshot=i == 0, stored=chunk))

    def _report(self, snapshot: bool = False, stored: list[CachedPrefix] | None = None,
                removed: list[int] | None = None, leaving: bool = False) -> CacheReport:
        running, waiting = self._load()
        report = CacheReport(worker_id=self._worker_id, model=self._model, started_at_ms=self._started_at_ms,
                             seq=self._seq, snapshot=snapshot, stored=stored or [], removed=removed or [],
                             partitions=[] if leaving else list(self._partitions), running=running,
                             waiting=waiting, leaving=leaving)
        self._seq += 1
        return report

    async def _send(self, report: CacheReport) -> None:
        catalog = self._sender.catalog
        await self._sender.send(catalog.cache_reports, report, self._worker_id)
