"""One request's token events as its reader sees them: delivered in ``seq`` order, exactly
once, through a small bounded queue, ending with the final event or an error that says why
(``ReplyStreamError``). The reply router (topics/replies.py) feeds them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import ClassVar

from tokenbus.schemas import TokenEvent

DEFAULT_QUEUE_SIZE = 4096

MAX_IDLE_TICK_S = 1.0  # how often at most the idle watch looks over waiting readers
FED = float("inf")  # a wait's start while events go to ``direct``: the idle watch restarts it at its next look

STREAM_IDLE = "stream_timeout"  # nothing arrived for the idle timeout: whatever generated it is gone
STREAM_OVERFLOW = "stream_overflow"  # the reader fell too far behind
ROUTER_STOPPED = "edge_stopping"


class ReplyStreamError(RuntimeError):
    """The stream cannot continue: its reader fell too far behind, nothing arrived in time,
    or the bus went away. ``code`` says which, for the client's error event."""

    def __init__(self, message: str, code: str = STREAM_IDLE) -> None:
        super().__init__(message)
        self.code = code


# Not frozen: made once per token event of every stream an edge relays, and a frozen dataclass's
# __init__ sets each field through object.__setattr__ (0.32 µs here against 0.11).
@dataclass(slots=True)
class ReplyEvent:
    """A token event and where it sits in the log."""

    event: TokenEvent
    partition: int
    offset: int

    @property
    def event_id(self) -> str:
        """Locates the event in the log (``partition-offset``): what the SSE ``id`` carries."""
        return f"{self.partition}-{self.offset}"


@dataclass(eq=False, slots=True)
class ReplyStream:
    """One request's token events, delivered in ``seq`` order exactly once.

    Its queue is a list and at most one waiting future, not an ``asyncio.Queue`` (three deques
    and an event) nor a deque (~0.7 KiB even empty): an edge holds one of these per open stream, a
    stream has one reader, and its queue holds an event or two at a time.

    A reader may also take events as they arrive, in the router's callback, with no wake-up of its
    task: ``direct`` is offered each event that comes while the reader waits with nothing queued,
    and takes it (True) or leaves it to be queued (False), which wakes the reader. The edge writes a
    stream's events to its client so (sse_edge/plumbing/stream_response.py, ``DirectWrites``): a task's
    wake-up costs as much Python as relaying the event."""

    request_id: str
    queue_size: int = DEFAULT_QUEUE_SIZE
    next_seq: int = 0
    _items: list[ReplyEvent | ReplyStreamError | None] = field(init=False, default_factory=list)
    _waiter: asyncio.Future[None] | None = field(init=False, default=None)
    _early: dict[int, ReplyEvent] = field(init=False, default_factory=dict)
    _done: bool = field(init=False, default=False)
    _waiting_since: float = field(init=False, default=0.0)  # when the reader began its current wait
    direct: Callable[[ReplyEvent], bool] | None = field(init=False, default=None)
    # Where what this stream delivers goes instead of its own queue: a group's (reply_group.py),
    # which reads several requests' streams as one.
    forward: Callable[[ReplyEvent | ReplyStreamError | None], None] | None = field(init=False, default=None)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The requests whose events this stream delivers (a group's are several)."""
        return (self.request_id,)

    @property
    def done(self) -> bool:
        return self._done

    @property
    def backlog(self) -> int:
        """Events delivered to this stream and not read yet."""
        return len(self._items)

    def offer(self, reply: ReplyEvent) -> bool:
        """Accept an event from the router; drop repeats, hold events that arrive early. Whether it
        was new rather than a repeat: which of two copies came first, for a router that takes both."""
        if reply.event.truncate:
            return self._truncate(reply)
        seq = reply.event.seq
        if self._done or seq < self.next_seq or seq in self._early:
            return False
        if seq == self.next_seq and not self._early:  # in order, as nearly always: the reorder dict stays empty
            self._push(reply)
            return True
        self._early[seq] = reply
        while self.next_seq in self._early and not self._done:
            self._push(self._early.pop(self.next_seq))
        return True

    def _truncate(self, reply: ReplyEvent) -> bool:
        """Output moderation stops the stream where the reader is: what was delivered stays
        delivered, nothing after it is (events held for later seqs are dropped)."""
        if self._done:
            return False
        self._early.clear()
        self._push(reply)
        return True

    def _push(self, reply: ReplyEvent) -> None:
        self.next_seq += 1
        if reply.event.is_final:
            self._done = True
        if len(self._items) >= self.queue_size:
            self.fail(ReplyStreamError(f"reply queue of {self.request_id} overflowed: reader too slow", STREAM_OVERFLOW))
        else:
            self._put(reply)

    def fail(self, error: ReplyStreamError) -> None:
        self._end(error)

    def end(self) -> None:
        """The final event was delivered before (a client resuming after the end): the reader
        gets nothing more and the stream ends cleanly."""
        if not self._done:
            self._end(None)

    def _end(self, item: ReplyStreamError | None) -> None:
        self._done = True
        if len(self._items) >= self.queue_size:
            del self._items[: len(self._items) - self.queue_size + 1]
        self._put(item)

    def _put(self, item: ReplyEvent | ReplyStreamError | None) -> None:
        if self.forward is not None:
            self.forward(item)
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():  # the reader waits, nothing is queued
            if self.direct is not None and type(item) is ReplyEvent and self.direct(item):
                self._waiting_since = FED  # taken: the wait goes on, yet not idle
                return
            waiter.set_result(None)
        self._items.append(item)

    async def events(self, idle_timeout: float | None = None) -> AsyncIterator[ReplyEvent]:
        """Yield events up to and including the final one; a wait of ``idle_timeout`` seconds with
        nothing arriving ends the stream with ``STREAM_IDLE``."""
        loop = asyncio.get_running_loop()
        idle = None
        if idle_timeout is not None:
            idle = _IdleWatch.of(loop)
            idle.add(self, idle_timeout)
        try:
            while True:
                # An event already queued is taken at once; a wait is one future, which the event's
                # arrival or the idle watch ends (no task, no timer per event: there is one per token).
                if not self._items:
                    self._waiter = loop.create_future()
                    if idle is not None:
                        self._waiting_since = loop.time()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
                item = self._items.pop(0)
                if item is None:
                    return
                if isinstance(item, ReplyStreamError):
                    raise item
                yield item
                if item.event.is_final:
                    return
        finally:
            if idle is not None:
                idle.remove(self)

    def _end_wait_if_idle(self, now: float, timeout: float) -> None:
        """End the reader's wait with ``STREAM_IDLE`` if nothing arrived for ``timeout`` seconds at ``now``
        (an event taken by ``direct`` since the last look counts as arriving now)."""
        if self._waiting_since == FED:
            self._waiting_since = now
        elif self._waiter is not None and not self._waiter.done() and now - self._waiting_since >= timeout:
            self._waiter.set_exception(ReplyStreamError(f"no token event for {timeout}s", STREAM_IDLE))


class _IdleWatch:
    """Ends the waits of the readers on one event loop that have waited their idle timeout. One timer
    for all of them rather than one per stream: a timer handle costs ~0.6 KiB (uvloop's handle, its
    context, a bound method) and an edge holds thousands of streams. It looks over the readers every
    quarter of the shortest timeout among them (at most every second), so a wait ends within that
    much after its timeout, and it stops when no reader is left."""

    __slots__ = ("_loop", "_readers", "_handle")
    _watches: ClassVar[dict[asyncio.AbstractEventLoop, _IdleWatch]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._readers: dict[ReplyStream, float] = {}  # each reader's idle timeout
        self._handle: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _IdleWatch:
        watch = cls._watches.get(loop)
        if watch is None:
            watch = cls._watches[loop] = cls(loop)
        return watch

    def add(self, stream: ReplyStream, timeout: float) -> None:
        self._readers[stream] = timeout
        if self._handle is None:
            self._handle = self._loop.call_later(self._tick(), self._look)

    def remove(self, stream: ReplyStream) -> None:
        self._readers.pop(stream, None)
        if not self._readers:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
            self._watches.pop(self._loop, None)  # nothing of a closed loop is kept

    def _tick(self) -> float:
        return min(MAX_IDLE_TICK_S, min(self._readers.values()) / 4)

    def _look(self) -> None:
        now = self._loop.time()
        for stream, timeout in list(self._readers.items()):
            stream._end_wait_if_idle(now, timeout)
        self._handle = self._loop.call_later(self._tick(), self._look) if self._readers else None
