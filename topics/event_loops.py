"""Which event loop a service process runs on. A service's time goes largely to socket reads and
writes and task wake-ups, which uvloop makes cheaper: on two cores, ~6 % more token events relayed
per edge CPU-second and ~5 % more output tokens per second at concurrency 128 (BENCHMARKS.md §1)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from typing import Literal

# A service's `loop` setting: `auto` takes uvloop where it is installed (it is installed with
# tokenbus), else asyncio's own loop.
EventLoop = Literal["auto", "asyncio", "uvloop"]


def wants_uvloop(choice: EventLoop) -> bool:
    return choice == "uvloop" or (choice == "auto" and importlib.util.find_spec("uvloop") is not None)


def loop_factory(choice: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """For ``asyncio.Runner``; None: asyncio's own loop."""
    if not wants_uvloop(choice):
        return None
    import uvloop

    return uvloop.new_event_loop
