"""Several requests' token streams read as one: the choices of one response (OpenAI's ``n``, or a
batch of prompts), each a request of its own on the bus. Each member stream keeps its own ``seq``
order and drops its own repeats (reply_stream.py) and forwards what it delivers here, as the
reply router (or a replay) offers it: so the group's events come out in the order they were read
from the log, which is what lets a client resume the group by one event id or by a chunk count.
(For that order a member takes fetched records alone, not the express lane's hand-overs, which
could overtake another writer's records: topics/replies.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

from tokenbus.topics.reply_stream import STREAM_IDLE, STREAM_OVERFLOW, ReplyEvent, ReplyStream, ReplyStreamError


class ReplyGroup:
    """The member streams' events, ending once every member has ended (its final event, or the
    end of a replay that found it delivered before) or with the first member's error."""

    __slots__ = ("request_id", "members", "_queue", "_limit", "_overflowed")

    def __init__(self, request_id: str, members: Iterable[ReplyStream]) -> None:
        """``members``: opened before any of their requests is published, so none has delivered yet."""
        self.request_id = request_id
        self.members = list(members)
        self._queue: asyncio.Queue[ReplyEvent | ReplyStreamError | None] = asyncio.Queue()
        self._limit = sum(member.queue_size for member in self.members)  # what the members would hold apart
        self._overflowed = False
        for member in self.members:
            member.forward = self._take

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(member.request_id for member in self.members)

    @property
    def done(self) -> bool:
        return all(member.done for member in self.members)

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def _take(self, item: ReplyEvent | ReplyStreamError | None) -> None:
        """What a member delivers; past the limit, the group fails as a member's own queue would."""
        if self._overflowed:
            return
        if self._queue.qsize() >= self._limit:
            self._overflowed = True
            item = ReplyStreamError(f"reply queue of {self.request_id} overflowed: reader too slow", STREAM_OVERFLOW)
        self._queue.put_nowait(item)

    async def events(self, idle_timeout: float | None = None) -> AsyncIterator[ReplyEvent]:
        """Yield the members' events as they come; a wait of ``idle_timeout`` seconds with nothing
        arriving from any member ends the group with ``STREAM_IDLE``."""
        still_open = len(self.members)
        while still_open:
            try:
                async with asyncio.timeout(idle_timeout):
                    item = await self._queue.get()
            except TimeoutError:
                raise ReplyStreamError(f"no token event for {idle_timeout}s", STREAM_IDLE) from None
            if item is None:  # a member replayed after its end: nothing more of it
                still_open -= 1
                continue
            if isinstance(item, ReplyStreamError):
                raise item
            yield item
            if item.event.is_final:
                still_open -= 1
