"""Which waiting request runs next.

Tiers share admissions by weight with stride scheduling: each tier has a "pass" that
grows by ``1 / weight`` per admission, and the waiting tier whose next pass is lowest
goes next. A tier of weight 16 is admitted 16 times for each admission of a tier of
weight 1 while both wait, so higher tiers go first and lower ones still move. A tier that was idle re-enters at
the current pass, so idling earns no burst. Within a tier, tenants take turns, so one
tenant's flood cannot starve another's requests.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from tokenbus.schemas import ChatRequest
from tokenbus.topics import tracing


@dataclass(eq=False)
class Pending:
    """A fetched request waiting for a slot."""

    request: ChatRequest
    tp: TopicPartition
    offset: int
    # Fetched from before this worker's assignment, so another worker may have started it: what
    # it already published, looked up as soon as the request is fetched.
    published: asyncio.Future | None = None
    trace: tracing.Context | None = None  # the trace context the request record carried
    failures: int = 0  # times serving it failed in this worker (it is then served again)

    @property
    def tenant(self) -> str:
        return self.request.tenant


@dataclass
class _TierQueue:
    weight: float
    pass_value: float = 0.0
    tenants: OrderedDict[str, deque[Pending]] = field(default_factory=OrderedDict)
    size: int = 0

    def push(self, pending: Pending) -> None:
        self.tenants.setdefault(pending.tenant, deque()).append(pending)
        self.size += 1

    def head(self) -> Pending:
        return next(iter(self.tenants.values()))[0]

    def pop_head(self) -> Pending:
        tenant, queue = next(iter(self.tenants.items()))
        pending = queue.popleft()
        del self.tenants[tenant]
        if queue:
            self.tenants[tenant] = queue  # back of the line: the next tenant goes next
        self.size -= 1
        return pending

    def remove_where(self, predicate: Callable[[Pending], bool]) -> list[Pending]:
        removed: list[Pending] = []
        for tenant in list(self.tenants):
            kept: deque[Pending] = deque()
            for pending in self.tenants[tenant]:
                (removed if predicate(pending) else kept).append(pending)
            if kept:
                self.tenants[tenant] = kept
            else:
                del self.tenants[tenant]
        self.size -= len(removed)
        return removed


class TierScheduler:
    def __init__(self, tiers: list[str], weights: dict[str, float]) -> None:
        self._tiers = {tier: _TierQueue(weight=max(weights.get(tier, 1.0), 1e-6)) for tier in tiers}
        self._by_id: dict[str, str] = {}

    def add(self, pending: Pending) -> None:
        queue = self._tiers[pending.request.tier]
        if queue.size == 0:
            queue.pass_value = max(queue.pass_value, self._current_pass())
        queue.push(pending)
        self._by_id[pending.request.request_id] = pending.request.tier

    def _current_pass(self) -> float:
        active = [q.pass_value for q in self._tiers.values() if q.size]
        return min(active) if active else 0.0

    def _next_tier(self) -> _TierQueue | None:
        active = [q for q in self._tiers.values() if q.size]
        return min(active, key=lambda q: q.pass_value + 1.0 / q.weight) if active else None

    def peek(self) -> Pending | None:
        queue = self._next_tier()
        return queue.head() if queue else None

    def pop(self) -> Pending | None:
        queue = self._next_tier()
        if queue is None:
            return None
        queue.pass_value += 1.0 / queue.weight
        pending = queue.pop_head()
        self._by_id.pop(pending.request.request_id, None)
        return pending

    def remove(self, request_id: str) -> Pending | None:
        tier = self._by_id.pop(request_id, None)
        if tier is None:
            return None
        removed = self._tiers[tier].remove_where(lambda p: p.request.request_id == request_id)
        return removed[0] if removed else None

    def remove_partitions(self, partitions: Iterable[TopicPartition]) -> list[Pending]:
        revoked = set(partitions)
        return self.remove_where(lambda p: p.tp in revoked)

    def remove_where(self, predicate: Callable[[Pending], bool]) -> list[Pending]:
        """Every waiting request ``predicate`` holds for, out of the queues."""
        removed = []
        for queue in self._tiers.values():
            removed += queue.remove_where(predicate)
        for pending in removed:
            self._by_id.pop(pending.request.request_id, None)
        return removed

    def waiting(self, tier: str | None = None) -> int:
        if tier is not None:
            return self._tiers[tier].size
        return sum(q.size for q in self._tiers.values())
