"""Readers on the embedded broker wait at a hole in a partition's offsets instead of passing it.

The embedded broker takes a write in two steps: it moves the partition's high-water mark past the
new batch, then stores the batch. When two producers write to one partition at once (two GPU
consumers answering into one reply log, workers of two models completing into one partition of
`completions`), a fetch can come between the steps: it finds the later batch stored and the
earlier one not yet, answers with the later, and the reader's position moves past the earlier,
which it never reads. A probe of four producers writing 3,000 records each into one partition
left a tailing reader 5 to 10 records short in every run, while a read from the start found all
12,000. On Kafka a partition's offsets are given and its batch appended in one step, and a fetch
never reads past the high-water mark, so a reader finds no hole there but those compaction
leaves, which never fill; so only the embedded profile installs this.

Installed, a fetched batch that starts past the reader's position ends what the fetch yields:
the position stays at the hole and the next fetch asks from there, by when the batch is stored.
A hole still there after ``HOLE_PATIENCE_S`` (a write the broker failed half-way) is passed
with a warning. aiokafka builds the records of each fetched partition with its fetcher module's
``PartitionRecords``; the class installed here is that class with the hole check, for every
consumer of the process (faust's included), which talks to one broker. The check costs about
0.15 µs per batch read (1.05 to 1.20 µs for a one-record batch), a fraction of a percent of
what the edge spends relaying an event.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import aiokafka.consumer.fetcher
from aiokafka import TopicPartition

log = logging.getLogger(__name__)

HOLE_PATIENCE_S = 2.0
_STALE_AFTER_S = 60.0  # holes first seen this long ago are forgotten (their reader moved on)

_first_seen: dict[tuple[TopicPartition, int], float] = {}  # (partition, offset a hole starts at) -> when


def _pass_hole(tp: TopicPartition, start: int, end: int) -> bool:
    """Whether a reader at ``start`` may pass the hole up to ``end``: it has waited long enough."""
    now = time.monotonic()
    first = _first_seen.setdefault((tp, start), now)
    if now - first < HOLE_PATIENCE_S:
        if len(_first_seen) > 10_000:
            for hole in [h for h, at in _first_seen.items() if now - at > _STALE_AFTER_S]:
                del _first_seen[hole]
        return False
    del _first_seen[(tp, start)]
    log.warning("%s-%d: offsets %d to %d were not stored after %.0f s; reading on past them",
                tp.topic, tp.partition, start, end - 1, HOLE_PATIENCE_S)
    return True


class _BatchesUpToHole:
    """A fetched partition's record batches (aiokafka's ``MemoryRecords``), ending before a
    batch that does not start where the records read so far end."""

    def __init__(self, records: Any, owner: PartitionRecordsWaitingAtHoles) -> None:
        self._records = records
        # Not the owner itself, which holds this: a cycle per fetched partition, freed only by the
        # garbage collector (topics/collector.py).
        self._owner = weakref.ref(owner)
        self._next: Any = None

    def has_next(self) -> bool:
        if self._next is None:
            if not self._records.has_next():
                return False
            self._next = self._records.next_batch()
        owner = self._owner()
        assert owner is not None  # it is who asks
        position = owner.next_fetch_offset
        if self._next.base_offset <= position:  # contiguous (or the batch holding the position)
            if _first_seen:
                _first_seen.pop((owner.tp, position), None)
            return True
        return _pass_hole(owner.tp, position, self._next.base_offset)

    def next_batch(self) -> Any:
        batch, self._next = self._next, None
        return batch


class PartitionRecordsWaitingAtHoles(aiokafka.consumer.fetcher.PartitionRecords):  # type: ignore[misc]
    def __init__(self, tp: TopicPartition, records: Any, *args: Any, **kwargs: Any) -> None:
        self.tp = tp
        super().__init__(tp, _BatchesUpToHole(records, self), *args, **kwargs)


def wait_at_holes() -> None:
    """Make every consumer of this process wait at holes (the embedded broker's readers)."""
    aiokafka.consumer.fetcher.PartitionRecords = PartitionRecordsWaitingAtHoles
