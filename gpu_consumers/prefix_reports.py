"""Telling routers what this worker's engine holds in its prefix cache (KV-cache-aware routing).

Routers name a prompt's prefixes by chain hashes of its segments (schemas/prefixes.py); engines
hold blocks of tokens. For each request it admits, the worker asks the engine where the request's
segments end in its prompt and which block holds the end of each: a prefix counts as cached while
that block is held (engines evict a prefix's last blocks first). After admissions, and every few
seconds to catch evictions, the worker checks those blocks and publishes what changed on
``kvcache`` as a CacheReport, with the request partitions it owns and its load; a full snapshot
goes out when the partitions change and every ``cache_snapshot_interval_s``, so a router that
starts late or missed a report catches up, and a snapshot is also the worker's heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
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
EVICTION_CHECK_S = 2.0  # how often held prefixes are checked when nothing is admitted


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

    def admitted(self, request: ChatRequest) -> None:
        """Watch the prefixes of a request the engine is about to prefill."""
        try:
            layout = self._cache.layout(GenerationInput.from_request(request))
        except Exception:  # a prompt the engine cannot render fails in the engine, where it is reported
            return
        block = layout.block_tokens
        for prefix, end in zip(segment_hashes(request), layout.segment_ends, strict=False):
            full_blocks = min(end // block, len(layout.block_hashes))
            if full_blocks:
                self._tracked[prefix] = (layout.block_hashes[full_blocks - 1], full_blocks * block)
                self._tracked.move_to_end(prefix)
        while len(self._tracked) > TRACKED_PREFIXES:
            self._tracked.popitem(last=False)
        self._changed.set()

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
        resident = self._cache.resident({block for block, _ in self._tracked.values()})
        now_held = {prefix: tokens for prefix, (block, tokens) in self._tracked.items() if block in resident}
        stored = [CachedPrefix(p, t) for p, t in now_held.items() if self._held.get(p) != t]
        removed = [p for p in self._held if p not in now_held]
        self._held = now_held
        load = self._load()
        if self._snapshot_due:
            self._snapshot_due = False
            await self._send_snapshot()
        elif stored or removed or load != self._last_load:
            await self._send(self._report(stored=stored, removed=removed))
        self._last_load = load

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
