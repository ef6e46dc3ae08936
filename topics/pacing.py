"""Fetching fitted to traffic: a reader's fetch wait, and on the embedded broker whether it
fetches at all, follow what it reads (``FetchPacer``). See docs/architecture.md."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from tokenbus.topics import doorbell
from tokenbus.topics.clients import cancel_task, doorbell_on, known_position, profile
from tokenbus.topics.lane_watch import LaneWatch
from tokenbus.topics.settings import BusSettings
from tokenbus.topics.starvation import StarvationWatch


class FetchPacer:
    """The fetching of one reader, fitted to its traffic.

    On the embedded broker a request-path reader asks for a few milliseconds (a fetch that finds
    no record is held for its whole wait, and not answered when one arrives), so an idle one
    would fetch hundreds of times a second. After ``idle_after_s`` with nothing read it fetches
    with the profile's idle wait, and where the stack has a doorbell (topics/doorbell.py) it stops
    fetching: its partitions are paused, fetched once every ``idle_poll_s``, and resumed when a
    writer rings. Records arriving bring the short wait back. ``wake()`` is for a reader that knows
    records are coming (the edge, once it has published a request, about its replies). A reader
    that says how many requests or streams it serves (``serving``) fetches with the profile's light
    wait while that is one or two, unless it has a wait of its own (``busy_wait_ms``). With the
    Kafka profile there is no doorbell, all waits are the same, and the pacer changes nothing.

    On the embedded broker a reader that the broker starves (its partition behind its log end and
    no fetch bringing anything: ``StarvationWatch``, topics/starvation.py) doubles its wait, and
    halves it again once it is fed.

    A reader whose records also come by the express lane (``express``, topics/doorbell.py: the
    GPU consumer's requests, the edge's token events, output moderation's) fetches, while light,
    with the profile's express wait instead, as long as the lane delivers: its fetches then only
    back the lane up. It tells the pacer what the lane brought (``handed_over``) and what a fetch
    brought first (``fetched_first``), and a miss (``LaneWatch``, topics/lane_watch.py: a record
    fetched whose copy does not follow on the lane, or ``lane_missed``) brings the light wait back
    until the lane has delivered a while again.

    A reader that says which topics its reads returned (``observed(records, topics)``) is also paced
    per topic: with a doorbell, the partitions of a topic it has read nothing from for
    ``idle_after_s`` are paused while the rest are read, and resumed when a writer rings for that
    topic (or by the periodic fetch). The embedded broker's cost of a fetch grows with the
    partitions it names (~40 µs each at a 5 ms wait, for it checks each while it holds the fetch),
    and a reader of several topics (the processors: ingress, tokens, completions, decisions) often
    has one busy and the rest silent.

    A reader may name ``background_topics``, whose records may wait: with the embedded profile their
    partitions rest paused, and are fetched in a spell every ``background_spell_every_s`` (the
    processors' completions: a request's billing needs no 5 ms poll, and was most of their fetching
    at concurrency 1). A spell lasts until a fetch has answered for its partitions and the reader
    has taken what that brought: about two fetches when nothing came, and as long as records keep
    coming, up to the whole period. A spell rather than a longer wait, because the embedded broker
    holds a fetch for its whole wait: a ring for another of the reader's topics would find such a
    fetch in flight and wait for it.

    ``observed`` and ``wake`` may be called from any thread: what touches the consumer runs in
    its own event loop (faust runs its consumer in a thread of its own)."""

    # A paused reader's periodic fetch: its partitions stay resumed this long, fetching with this
    # wait (short, so that a ring arriving meanwhile finds no long fetch in flight).
    BACKSTOP_FETCH_S = 0.05
    BACKSTOP_WAIT_MS = 20
    QUIET_CHECK_S = 0.25
    LIGHT_IN_FLIGHT = 2  # up to this many requests or streams in flight, the light wait
    BACKGROUND_SPELL_S = 0.02  # a spell no fetch answers (a fetch at the busy wait starts and returns within it)
    SPELL_CHECK_S = 0.002  # how often a spell looks whether its fetch has answered
    IDLE_SPELLS_CHECK_S = 1.0  # an idle reader has no spells: how often it looks whether it still is

    def __init__(self, settings: BusSettings, busy_wait_ms: int | None = None, background: bool = False,
                 pauses: bool = True, on_ring: Callable[[str], None] | None = None, express: bool = False,
                 background_topics: Iterable[str] = ()) -> None:
        """``background`` for a reader made with ``make_consumer(..., background=True)``;
        ``pauses=False`` for one that must never be paused (it only lengthens its wait when idle);
        ``on_ring`` hears the topic each ring names, in the consumer's event loop; ``express`` for a
        reader that also takes its records from the express lane; ``background_topics``, those of
        its topics fetched in spells."""
        tuned = profile(settings)
        default_wait_ms = tuned.background_fetch_max_wait_ms if background else tuned.fetch_max_wait_ms
        self._base_wait_ms = busy_wait_ms or default_wait_ms
        # A wait of the reader's own is its latency budget: no light wait below it.
        light_wait_ms = None if busy_wait_ms else tuned.light_fetch_max_wait_ms
        self._light_wait_ms = min(light_wait_ms or self._base_wait_ms, self._base_wait_ms)
        self._light = False
        self._express_wait_ms = tuned.express_fetch_max_wait_ms if express else 0
        self._lane = LaneWatch()
        self._lane_trusted = False  # light, and the lane brought every record lately
        self._idle_wait_ms = tuned.idle_fetch_max_wait_ms
        self._starvation = StarvationWatch(self._base_wait_ms) if tuned.raise_wait_when_starved else None
        self._pauses = pauses
        self._idle_after_s = tuned.idle_after_s
        self._idle_poll_s = tuned.idle_poll_s
        self._doorbell_url = settings.doorbell_url if doorbell_on(settings) else None
        self._topic_prefix = settings.topic_prefix
        self._on_ring = on_ring
        self._consumer: AIOKafkaConsumer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: asyncio.Task[None] | None = None
        self._spell_every_s = tuned.background_spell_every_s
        self._background_topics = frozenset(background_topics) if self._spell_every_s else frozenset()
        self._spells: asyncio.Task[None] | None = None
        self._resting: set[TopicPartition] = set()  # background partitions paused between spells
        self._paused: set[TopicPartition] = set()  # paused by the pacer (not by anyone else)
        self._held: set[TopicPartition] = set()  # paused by the reader itself (hold)
        self._quiet: set[TopicPartition] = set()  # paused by the pacer because their topic is quiet
        self._topic_heard: dict[str, float] = {}  # topic -> when a read returned records of it, or a ring named it
        self._next_quiet_check = 0.0
        self._backstop_until = 0.0
        self._last_active = time.monotonic()
        self._idle = False
        self._next_starved_check = 0.0

    def attach(self, consumer: AIOKafkaConsumer) -> None:
        """The consumer to pace; call it from the consumer's event loop. A started consumer fetches
        with the pacer's wait from then on (one not started yet, with its own until it starts)."""
        self._consumer = consumer
        self._paused.clear()
        self._quiet.clear()
        self._idle, self._last_active = False, time.monotonic()
        self._set_wait(self.fetch_wait_ms)
        url = self._doorbell_url
        loop = asyncio.get_running_loop() if url else None
        if url and loop is not None and loop is not self._loop:  # the first consumer, or one in a new loop
            self._loop = loop
            self._listener = loop.create_task(self._listen(url))
        self._resting.clear()
        running = asyncio.get_running_loop()
        if self._background_topics and (self._spells is None or self._spells.get_loop() is not running):
            self._spells = running.create_task(self._background_spells())

    async def close(self) -> None:
        await cancel_task(self._listener)
        await cancel_task(self._spells)

    @property
    def idle(self) -> bool:
        return self._idle

    @property
    def _busy_wait_ms(self) -> int:
        """The wait while records flow: the reader's own, or what starving made of it."""
        return self._starvation.wait_ms if self._starvation is not None else self._base_wait_ms

    @property
    def fetch_wait_ms(self) -> int:
        """The wait the reader's fetches ask for now."""
        if self._idle:
            return max(self._busy_wait_ms, self._idle_wait_ms)
        if self._lane_trusted:
            return max(self._express_wait_ms, self._busy_wait_ms)
        if self._light and self._busy_wait_ms == self._base_wait_ms:
            return self._light_wait_ms
        return self._busy_wait_ms

    @property
    def paused(self) -> bool:
        """Idle with the doorbell: the reader fetches only when rung (or once every ``idle_poll_s``)."""
        return bool(self._paused)

    def observed(self, records: int, topics: Iterable[str] | None = None) -> None:
        """After each read: how many records it returned, and where the reader knows, of which topics."""
        now = time.monotonic()
        if topics is not None:
            for topic in topics:
                self._topic_heard[topic] = now
            if now >= self._next_quiet_check and self._loop is not None and self._pauses:
                self._next_quiet_check = now + self.QUIET_CHECK_S
                self._in_consumer_loop(self._pause_quiet_topics, now)
        if records:
            self._last_active = now
            self._in_consumer_loop(self._set, False)
        elif now - self._last_active >= self._idle_after_s:
            self._in_consumer_loop(self._set, True)
        if self._starvation is not None and now >= self._next_starved_check:
            self._next_starved_check = now + self._starvation.CHECK_S
            self._in_consumer_loop(self._check_starved, now)

    def serving(self, in_flight: int | None) -> None:
        """How many requests or streams the reader serves now; call it from the consumer's loop.
        Up to ``LIGHT_IN_FLIGHT`` it fetches with the profile's light wait, or its express wait
        while the lane delivers. ``None`` for a reader of every writer's records, which cannot
        count them: whether the lane delivers decides alone."""
        light = in_flight is None or in_flight <= self.LIGHT_IN_FLIGHT
        watching = light and self._express_wait_ms > 0
        trusted = watching and self._lane.trusted()
        if not watching:
            self._lane.forget_fetched()
        if light != self._light or trusted != self._lane_trusted:
            self._light, self._lane_trusted = light, trusted
            self._set_wait(self.fetch_wait_ms)

    @property
    def watching_lane(self) -> bool:
        """Whether the reader should say what its fetches and the lane bring (light, with a lane)."""
        return self._light and self._express_wait_ms > 0

    def fetched_first(self, topic: str, partition: int, offset: int) -> None:
        """A fetch brought a record the reader waited for that it had not taken from the lane."""
        self._lane.fetched_first((topic, partition, offset))

    def handed_over(self, topic: str, partition: int, offset: int) -> None:
        """The lane brought a record, first or after the fetch."""
        self._lane.handed_over((topic, partition, offset))

    def lane_missed(self) -> None:
        """Records come other than by the lane for now (a partition new to the reader, say); call it
        from the consumer's loop."""
        self._lane.missed()
        if self._lane_trusted:
            self._lane_trusted = False
            self._set_wait(self.fetch_wait_ms)

    def observed_by_topic(self, batches: dict[TopicPartition, list[Any]]) -> None:
        """After a ``getmany`` of a reader paced per topic: what it returned."""
        self.observed(sum(map(len, batches.values())), {tp.topic for tp in batches})

    def hold(self, partitions: set[TopicPartition]) -> None:
        """The reader's own pauses (a GPU consumer's full tiers), through the pacer, so that neither
        undoes the other: ``partitions`` stay paused whatever the traffic, and a partition no longer
        held is resumed, and one let go while the reader is idle wakes it. Call it from the
        consumer's event loop."""
        consumer = self._consumer
        if consumer is None:
            return
        released, self._held = self._held - partitions, set(partitions)
        # A held partition has records waiting (its tier was full), rung for long before: its
        # topic is not quiet, or the quiet check would pause it again before its first fetch.
        now = time.monotonic()
        for tp in (*partitions, *released):
            self._topic_heard[tp.topic] = now
        assigned, paused = consumer.assignment(), consumer.paused()
        newly_held = [tp for tp in partitions if tp in assigned and tp not in paused]  # a rebalance unpauses
        if newly_held:
            self._pause_partitions(newly_held)
        released = {tp for tp in released if tp in assigned}
        if released:
            consumer.resume(*released)
            if self._paused and self._pauses:
                # Idle meanwhile (a tier can stay full past ``idle_after_s`` while long generations
                # hold every slot): what it let go of was rung for long ago, so no ring is coming
                # and it would wait for the periodic fetch (10 s of empty slots). It wakes, as a
                # ring would wake it.
                self.wake()

    def wake(self) -> None:
        """Records are coming, on any of the reader's topics."""
        now = self._last_active = time.monotonic()
        self._topic_heard = dict.fromkeys(self._topic_heard, now)
        self._in_consumer_loop(self._set, False)
        self._in_consumer_loop(self._resume_quiet, None)

    def _rung(self, topic: str) -> None:
        self._last_active = self._topic_heard[topic] = time.monotonic()
        self._in_consumer_loop(self._set, False)
        self._in_consumer_loop(self._resume_quiet, topic)
        if self._on_ring is not None:
            self._on_ring(topic)

    def _in_consumer_loop(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            if loop is None:
                fn(*args)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    def _set(self, idle: bool) -> None:
        if idle != self._idle:
            self._idle = idle
            self._set_wait(self.fetch_wait_ms)
        if self._loop is None:
            return
        if not idle:
            self._resume()
        elif self._pauses and time.monotonic() >= self._backstop_until:
            self._pause()  # again after a rebalance: new partitions come unpaused

    def _check_starved(self, now: float) -> None:
        if self._consumer is not None and self._starvation is not None and self._starvation.check(self._consumer, now):
            self._set_wait(self.fetch_wait_ms)

    def _pause_partitions(self, partitions: list[TopicPartition]) -> None:
        assert self._consumer is not None
        self._consumer.pause(*partitions)
        if self._starvation is not None:
            self._starvation.paused(partitions)

    def _set_wait(self, wait_ms: int) -> None:
        fetcher = getattr(self._consumer, "_fetcher", None)  # aiokafka reads it for every fetch request it builds
        if fetcher is not None:
            fetcher._fetch_max_wait_ms = wait_ms

    def _pause(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        already = consumer.paused()
        fresh = [tp for tp in consumer.assignment() if tp not in already]
        if fresh:
            self._pause_partitions(fresh)
            self._paused.update(fresh)
        if self._resting:  # paused already: they wait for the doorbell with the rest
            self._paused.update(self._resting)
            self._resting.clear()

    def _resume(self) -> None:
        if self._paused:
            paused, self._paused = self._paused, set()
            self._resume_partitions(paused)

    def _pause_quiet_topics(self, now: float) -> None:
        """Pause the partitions of topics the reader has heard nothing of for ``idle_after_s``, unless
        it is idle (then all are paused) or in its periodic fetch."""
        consumer = self._consumer
        if consumer is None or self._idle or now < self._backstop_until:
            return
        paused = consumer.paused()
        self._quiet &= paused  # a rebalance or a new assignment unpauses
        heard = self._topic_heard
        quiet = [tp for tp in consumer.assignment()
                 if tp not in paused and now - heard.setdefault(tp.topic, now) >= self._idle_after_s]
        if quiet:
            self._pause_partitions(quiet)
            self._quiet.update(quiet)
        if len(heard) > 256:  # rolled logs come and go
            assigned = {tp.topic for tp in consumer.assignment()}
            self._topic_heard = {topic: at for topic, at in heard.items() if topic in assigned}

    def _resume_quiet(self, topic: str | None) -> None:
        """Resume the quiet partitions of ``topic``, or all of them."""
        woken = {tp for tp in self._quiet if topic is None or tp.topic == topic}
        if woken:
            self._quiet -= woken
            self._resume_partitions(woken)

    def _resume_partitions(self, partitions: set[TopicPartition]) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        assigned = consumer.assignment()
        mine = [tp for tp in partitions if tp in assigned and tp not in self._held]
        if mine:
            consumer.resume(*mine)
            # aiokafka notices resumed partitions on its next loop (up to 0.2 s): fetch now.
            waiter = getattr(getattr(consumer, "_fetcher", None), "_wait_consume_future", None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _background_spells(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._idle:  # no spells: an idle reader pauses them with the rest, or fetches them at its idle wait
                self._end_rest()
                await asyncio.sleep(self.IDLE_SPELLS_CHECK_S)
                continue
            await asyncio.sleep(self._spell_every_s)
            spell, since_ms = set(self._resting), int(time.time() * 1000)
            self._end_rest()
            # Over once a fetch has answered for every partition of the spell and the reader has
            # taken what it brought (a partition paused with fetched records unread loses them to a
            # fetch again); a partition no fetch answers holds it the short spell at most, and
            # records coming faster than the reader takes them a whole period.
            short = loop.time() + max(self.BACKGROUND_SPELL_S, 3 * self._busy_wait_ms / 1000)
            long = loop.time() + self._spell_every_s
            while (now := loop.time()) < long:
                answered, unread = self._spell_progress(spell, since_ms)
                if not unread and (answered or now >= short):
                    break
                await asyncio.sleep(self.SPELL_CHECK_S)
            self._rest()

    def _spell_progress(self, spell: set[TopicPartition], since_ms: int) -> tuple[bool, bool]:
        """Whether a fetch has answered for every partition of ``spell`` since ``since_ms`` (a wall
        clock, as aiokafka stamps its fetch responses), and whether one of them holds fetched records
        the reader has not taken (its position short of the log end that fetch reported)."""
        consumer = self._consumer
        if consumer is None:
            return True, False
        assigned = consumer.assignment()
        answered, unread = True, False
        for tp in spell & assigned:
            stamp, position = consumer.last_poll_timestamp(tp), known_position(consumer, tp)
            if stamp is None or stamp < since_ms or position is None:
                answered = False
            elif position < (consumer.highwater(tp) or 0):
                unread = True
        return answered, unread

    def _rest(self) -> None:
        """Pause the background topics' partitions until the next spell."""
        consumer = self._consumer
        if consumer is None or self._idle:
            return
        paused = consumer.paused()
        resting = [tp for tp in consumer.assignment() if tp.topic in self._background_topics and tp not in paused]
        if resting:
            self._pause_partitions(resting)
            self._resting.update(resting)

    def _end_rest(self) -> None:
        if self._resting:
            resting, self._resting = self._resting, set()
            self._resume_partitions(resting)

    async def _listen(self, url: str) -> None:
        rings = asyncio.create_task(doorbell.listen(url, self._topic_prefix, self._rung))
        try:
            while True:
                await asyncio.sleep(self._idle_poll_s)
                # The periodic fetch, of quiet topics too: a lost ring costs latency only.
                idle = self._idle and bool(self._paused)
                if idle or self._quiet:
                    self._backstop_until = time.monotonic() + self.BACKSTOP_FETCH_S
                    self._resume_quiet(None)  # a reader still busy pauses them again at its next check
                if idle:
                    self._set_wait(self.BACKSTOP_WAIT_MS)
                    self._resume()
                    await asyncio.sleep(self.BACKSTOP_FETCH_S)
                    if self._idle:
                        self._pause()
                        self._set_wait(self.fetch_wait_ms)
        finally:
            await cancel_task(rings)
