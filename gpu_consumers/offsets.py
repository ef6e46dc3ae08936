"""Low-water-mark offset tracking: commit only below the oldest unfinished request.

Requests finish out of order; committing the highest finished offset would lose the
unfinished ones below it on a crash. Committing at the low-water mark redelivers
exactly the requests that had not finished (at-least-once).
"""

from __future__ import annotations

from aiokafka import TopicPartition


class OffsetTracker:
    def __init__(self) -> None:
        self._pending: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def started(self, tp: TopicPartition, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def finished(self, tp: TopicPartition, offset: int) -> None:
        self._pending.get(tp, set()).discard(offset)

    def in_flight(self, tp: TopicPartition) -> int:
        return len(self._pending.get(tp, ()))

    def committable(self) -> dict[TopicPartition, int]:
        """The offset to commit for each partition whose low-water mark moved since the last commit."""
        moves: dict[TopicPartition, int] = {}
        for tp, next_offset in self._next.items():
            pending = self._pending.get(tp)
            low_water = min(pending) if pending else next_offset
            if low_water > self._committed.get(tp, -1):
                moves[tp] = low_water
        return moves

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        self._committed.update(offsets)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Drop partitions this worker no longer owns."""
        for tp in partitions:
            self._pending.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)
