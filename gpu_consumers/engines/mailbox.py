"""How an engine hands a sequence's outputs to the one task reading them: a step per token, so
the hand-over is on the GPU consumer's hot path. ``asyncio.Queue`` does more than this needs
(bounds, task accounting, many getters and putters: ~1.9 µs a put and get on uvloop); a mailbox
is an unbounded deque with at most one waiting reader."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    __slots__ = ("_items", "_reader")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._reader: asyncio.Future[None] | None = None

    def put(self, item: T) -> None:
        self._items.append(item)
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done():
            reader.set_result(None)

    async def get(self) -> T:
        while not self._items:
            if self._reader is not None:
                raise RuntimeError("a mailbox has one reader")
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        return self._items.popleft()

    def first(self) -> T:
        """The next item, left in the box (``IndexError`` if it is empty)."""
        return self._items[0]

    def take(self) -> T:
        """The next item without waiting (``IndexError`` if it is empty)."""
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)
