"""Whether the express lane (topics/doorbell.py) brings a reader every record it waits for: the
judgement behind ``FetchPacer``'s express wait, kept apart from the fetching it decides.

A reader tells the watch what the lane brought (``handed_over``) and what a fetch brought that it
had not taken from the lane (``fetched_first``). A record fetched first whose copy does not come by
the lane within ``GRACE_S`` (its writer was not light, or the hand-over was lost) is a miss, and so
is ``missed()``: the lane is trusted again once ``TRUST_AFTER_S`` has passed without a miss and
with the lane heard meanwhile. A copy that comes after the fetched one only lost a race, which at a
short fetch wait it often does; one that came before it and was not taken (it waited its turn
behind the fetch's records, or the reader refused it) was brought all the same.
"""

from __future__ import annotations

import time

Place = tuple[str, int, int]  # topic, partition, offset


class LaneWatch:
    TRUST_AFTER_S = 2.0
    GRACE_S = 0.1
    REMEMBERED = 256  # records kept on either side: past it, the lane has missed, or was heard long ago

    def __init__(self) -> None:
        self._missed_at = time.monotonic()  # not trusted before it has delivered a while
        self._heard_at = float("-inf")
        self._unconfirmed: dict[Place, float] = {}  # fetched first, no copy by the lane yet: when
        self._heard: dict[Place, None] = {}  # came by the lane, not fetched yet (the latest few)

    def trusted(self) -> bool:
        """Whether the lane brought every record lately; a fetched record past its grace is a miss."""
        now = time.monotonic()
        unconfirmed = self._unconfirmed
        if unconfirmed and now - next(iter(unconfirmed.values())) >= self.GRACE_S:  # the oldest
            unconfirmed.clear()
            self._missed_at = now
        return now - self._missed_at >= self.TRUST_AFTER_S and now - self._heard_at < self.TRUST_AFTER_S

    def forget_fetched(self) -> None:
        """The reader stopped watching (under load nobody hands over): what it fetched proves nothing."""
        self._unconfirmed.clear()

    def fetched_first(self, place: Place) -> None:
        if place in self._heard:
            del self._heard[place]
        elif len(self._unconfirmed) >= self.REMEMBERED:
            self.missed()
        else:
            self._unconfirmed[place] = time.monotonic()

    def handed_over(self, place: Place) -> None:
        self._heard_at = time.monotonic()
        if self._unconfirmed.pop(place, None) is None:
            heard = self._heard
            heard[place] = None
            if len(heard) > self.REMEMBERED:
                del heard[next(iter(heard))]

    def missed(self) -> None:
        self._missed_at = time.monotonic()
        self._unconfirmed.clear()
