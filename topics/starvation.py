"""Whether the embedded broker starves a reader: the judgement behind ``FetchPacer``'s busy wait on
that broker, kept apart from the fetching it decides.

The embedded broker lists every record batch of a partition on each fetch and answers nothing
when that outlasts the wait, so a long-lived partition stops delivering to a reader with a short
wait (at 5 ms, after some thousands of batches on these machines). A reader whose unpaused
partition stays behind its log end (the high-water mark of the last fetch) from one check to the
next (``CHECK_S`` apart) doubles its wait, up to ``MAX_WAIT_MS``, and halves it again after
``RELAX_S`` without starving. A partition paused meanwhile (a GPU consumer holds a full tier's
partitions, and lets them go a fetch later) read nothing because it was paused, not because the
broker starved it: the pacer says so (``paused``).
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer, TopicPartition

from tokenbus.topics.clients import known_position

log = logging.getLogger(__name__)


class StarvationWatch:
    CHECK_S = 0.5
    RELAX_S = 30.0
    MAX_WAIT_MS = 1000

    def __init__(self, base_wait_ms: int) -> None:
        self.base_wait_ms = self.wait_ms = base_wait_ms
        self._behind: dict[TopicPartition, int] = {}  # partitions behind their log end: position at the last check
        self._paused_lately: set[TopicPartition] = set()  # paused at some time since the last check
        self._changed_at = 0.0

    def paused(self, partitions: list[TopicPartition]) -> None:
        self._paused_lately.update(partitions)

    def check(self, consumer: AIOKafkaConsumer, now: float) -> bool:
        """Look again where ``consumer`` stands; True if ``wait_ms`` changed."""
        paused = consumer.paused()
        behind = {}
        for tp in consumer.assignment():
            highwater, position = consumer.highwater(tp), known_position(consumer, tp)
            if tp not in paused and highwater is not None and position is not None and highwater > position:
                behind[tp] = position
        starved = [tp for tp, position in behind.items()
                   if self._behind.get(tp) == position and tp not in self._paused_lately]
        self._behind, self._paused_lately = behind, set()
        if starved and self.wait_ms < self.MAX_WAIT_MS:
            self.wait_ms = min(self.wait_ms * 2, self.MAX_WAIT_MS)
            log.warning("%s-%s gets nothing though its log goes on (the broker's scan outlasts the fetch wait): "
                        "fetching with %d ms", starved[0].topic, starved[0].partition, self.wait_ms)
        elif not starved and self.wait_ms > self.base_wait_ms and now - self._changed_at >= self.RELAX_S:
            self.wait_ms = max(self.wait_ms // 2, self.base_wait_ms)
        else:
            return False
        self._changed_at = now
        return True
