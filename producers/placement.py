"""KV-cache-aware placement: send a request to the partition whose GPU consumer already holds the
longest prefix of its prompt, so its engine skips most of the prefill.

GPU consumers report on ``kvcache`` which prompt prefixes their engines hold, the request partitions
they own and their load (gpu_consumers/prefix_reports.py). ``PrefixIndex`` keeps that as a map from
prefix (schemas/prefixes.py) to the workers holding it; ``PrefixRouter`` reads the reports and asks
the index where each request goes. The choice, for a request on topic ``T``:

1. Among live workers owning partitions of ``T``, the one holding the longest prefix of the prompt
   (the most tokens of it, then the least load).
2. Unless that worker is overloaded: its load (running + waiting, plus what this router sent it
   since its last report and has not seen finish) above 1.5 times the mean and a few requests
   over it (a worker running two sequences while the others idle is not overloaded: batching
   makes the third nearly free). Then the least-loaded worker takes it (``balance``), and caches
   the prefix too, so a hot prompt spreads over as many workers as its load needs.
3. Knowing nothing useful (no worker holds any prefix), the partition is left to the key: requests
   of one conversation share a partition, as without this router (``miss``; ``unknown`` when no
   worker has reported at all).

Between a request landing and its consumer reporting the prefix cached (its prefill, then up to a
report interval), the router expects the prefix there: a request with the same prefix meanwhile
follows it (``expected``) rather than seeding the prefix on a second consumer by its key.

Among the chosen worker's partitions of ``T`` the conversation's key picks one, so a conversation's
turns keep their order. A stale index costs a cache miss, never a request: a request on a
partition whose owner moved is simply served by the new owner. The decision is noted on the request
(``route``, ``route.hit_tokens``, ``route.worker``) for ``tokenbus trace`` and metrics.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenbus.schemas import AvroCodec, CacheReport, ChatRequest
from tokenbus.schemas.prefixes import segment_hashes
from tokenbus.topics import BusSettings, TopicCatalog, TopicTail

OVERLOAD = 1.5  # a worker above this many times the mean load (and SLACK requests more)
SLACK = 2  # gets no more requests for its cache
EXPECT_S = 5.0  # how long a prefix sent to a consumer is expected there without its report
EXPECTED_MAX = 20_000
ROUTE_PREFIX = "prefix"
ROUTE_EXPECTED = "expected"
ROUTE_BALANCE = "balance"
ROUTE_MISS = "miss"
ROUTE_UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Placement:
    partition: int | None  # None: by the request's key
    reason: str
    hit_tokens: int = 0
    worker_id: str = ""
    prefixes: tuple[int, ...] = ()  # the request's, longest first (what landing expects where it lands)

    def annotations(self) -> dict[str, str]:
        notes = {"route": self.reason, "route.hit_tokens": str(self.hit_tokens)}
        if self.worker_id:
            notes["route.worker"] = self.worker_id
        return notes


@dataclass(eq=False)
class _Worker:
    worker_id: str
    started_at_ms: int
    seen_at: float
    partitions: list[tuple[str, int]] = field(default_factory=list)
    prefixes: dict[int, int] = field(default_factory=dict)  # prefix -> cached tokens
    load: int = 0  # running + waiting, as last reported
    # Request ids sent here by this router since that report and not finished: reports reach a
    # router a few hundred ms apart, in which one user's short turns, one after another, would
    # otherwise count as a pile of load and send the next turn away from its cache.
    placed: set[str] = field(default_factory=set)


class PrefixIndex:
    """What every GPU consumer of one bus caches, owns and runs; no I/O, so it is easy to test."""

    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._workers: dict[str, _Worker] = {}
        self._holders: dict[int, dict[str, int]] = {}  # prefix -> worker -> cached tokens
        self._owners: dict[tuple[str, int], str] = {}  # (topic, partition) -> worker that last claimed it
        self._expected: OrderedDict[int, dict[str, float]] = OrderedDict()  # prefix -> worker -> until

    @property
    def workers(self) -> list[str]:
        return sorted(self._workers)

    def apply(self, report: CacheReport, now: float) -> None:
        worker = self._workers.get(report.worker_id)
        if worker is not None and report.started_at_ms < worker.started_at_ms:
            return  # from an earlier run of that worker
        if report.leaving:
            self._forget(report.worker_id)
            return
        if worker is None or report.started_at_ms > worker.started_at_ms:
            self._forget(report.worker_id)
            worker = self._workers[report.worker_id] = _Worker(report.worker_id, report.started_at_ms, now)
        if report.snapshot:
            self._drop_prefixes(worker, list(worker.prefixes))
        self._drop_prefixes(worker, report.removed)
        for prefix in report.stored:
            worker.prefixes[prefix.hash] = prefix.tokens
            self._holders.setdefault(prefix.hash, {})[worker.worker_id] = prefix.tokens
            self._expected.get(prefix.hash, {}).pop(worker.worker_id, None)  # confirmed
        for tp in worker.partitions:
            if self._owners.get(tp) == worker.worker_id:
                del self._owners[tp]
        worker.partitions = list(report.partitions)
        for tp in worker.partitions:
            self._owners[tp] = worker.worker_id  # the latest claim wins: ownership just moved here
        worker.load, worker.seen_at = report.running + report.waiting, now
        worker.placed.clear()

    def _drop_prefixes(self, worker: _Worker, prefixes: list[int]) -> None:
        for prefix in prefixes:
            worker.prefixes.pop(prefix, None)
            holders = self._holders.get(prefix)
            if holders is not None:
                holders.pop(worker.worker_id, None)
                if not holders:
                    del self._holders[prefix]

    def _forget(self, worker_id: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._drop_prefixes(worker, list(worker.prefixes))
        for tp in worker.partitions:
            if self._owners.get(tp) == worker_id:
                del self._owners[tp]

    def landed(self, placement: Placement, topic: str, partition: int, now: float) -> None:
        """The request placed so was written to ``partition``: expect its prefixes at that partition's owner."""
        worker_id = self._owners.get((topic, partition))
        if worker_id is None:
            return
        for prefix in placement.prefixes:
            self._expected.setdefault(prefix, {})[worker_id] = now + EXPECT_S
            self._expected.move_to_end(prefix)
        while len(self._expected) > EXPECTED_MAX:
            self._expected.popitem(last=False)

    def finished(self, request_id: str) -> None:
        """A request this router placed has ended: it no longer loads its worker."""
        for worker in self._workers.values():
            worker.placed.discard(request_id)

    def place(self, request: ChatRequest, topic: str, now: float) -> Placement:
        for worker in [w for w in self._workers.values() if now - w.seen_at > self.stale_after_s]:
            self._forget(worker.worker_id)  # silent for too long: dead, or cut off from the bus
        owned: dict[str, list[int]] = {}
        for (owned_topic, partition), worker_id in self._owners.items():
            if owned_topic == topic:
                owned.setdefault(worker_id, []).append(partition)
        if not owned:
            return Placement(None, ROUTE_UNKNOWN)
        candidates = [self._workers[w] for w in owned]
        prefixes = segment_hashes(request)[::-1]  # longest first
        hit = self._longest_hit(prefixes, {w.worker_id for w in candidates}, now)
        if hit is None:
            return Placement(None, ROUTE_MISS, prefixes=tuple(prefixes))
        chosen, tokens = hit
        reason = ROUTE_PREFIX if tokens else ROUTE_EXPECTED
        mean = sum(self._load(w) for w in candidates) / len(candidates)
        if self._load(chosen) > OVERLOAD * mean + SLACK:
            chosen = min(candidates, key=lambda w: (self._load(w), w.worker_id))
            tokens = next((chosen.prefixes[p] for p in prefixes if p in chosen.prefixes), 0)
            reason = ROUTE_BALANCE
        chosen.placed.add(request.request_id)
        partitions = sorted(owned[chosen.worker_id])
        partition = partitions[zlib.crc32(request.partition_key.encode()) % len(partitions)]
        return Placement(partition, reason, tokens, chosen.worker_id, tuple(prefixes))

    @staticmethod
    def _load(worker: _Worker) -> int:
        return worker.load + len(worker.placed)

    def _longest_hit(self, prefixes: list[int], candidates: set[str], now: float) -> tuple[_Worker, int] | None:
        """The candidate holding the longest prefix (most tokens, then least load), with its cached
        tokens: 0 where the prefix is only expected there."""
        for prefix in prefixes:
            holders = {w: t for w, t in self._holders.get(prefix, {}).items() if w in candidates}
            for w, until in self._expected.get(prefix, {}).items():
                if until > now and w in candidates:
                    holders.setdefault(w, 0)
            if holders:
                best = max(holders, key=lambda w: (holders[w], -self._load(self._workers[w]), w))
                return self._workers[best], holders[best]
        return None


class PrefixRouter:
    """Follows ``kvcache`` from now on (a worker's next snapshot fills in what came before) and
    places requests with the index; ``on_placed`` sees every decision (the edge counts them)."""

    def __init__(self, settings: BusSettings, codec: AvroCodec, stale_after_s: float = 30.0,
                 on_placed: Callable[[Placement], None] | None = None) -> None:
        self.index = PrefixIndex(stale_after_s)
        self._on_placed = on_placed
        self._tail = TopicTail(settings, codec, TopicCatalog(settings).cache_reports, CacheReport, self._on_report,
                               "prefix-router")

    async def start(self) -> None:
        await self._tail.start()

    async def stop(self) -> None:
        await self._tail.stop()

    def _on_report(self, report: CacheReport) -> None:
        self.index.apply(report, asyncio.get_running_loop().time())

    def place(self, request: ChatRequest, topic: str) -> Placement:
        placement = self.index.place(request, topic, asyncio.get_running_loop().time())
        if self._on_placed is not None:
            self._on_placed(placement)
        return placement

    def landed(self, placement: Placement, topic: str, partition: int) -> None:
        self.index.landed(placement, topic, partition, asyncio.get_running_loop().time())

    def finished(self, request_id: str) -> None:
        self.index.finished(request_id)
