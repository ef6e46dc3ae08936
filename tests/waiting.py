"""Waiting for what happens in the background: poll a condition until it holds, or fail saying
what was awaited. A timeout only bounds how long a failing test takes (generous, for slow
machines); it is never a figure under test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest


async def wait_for(condition: Callable[[], object], timeout: float = 30.0, what: str = "the condition",
                   details: Callable[[], object] = lambda: "", interval: float = 0.05) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what} {details()}".rstrip())
        await asyncio.sleep(interval)


def wait_for_blocking(condition: Callable[[], object], timeout: float = 30.0, what: str = "the condition",
                      interval: float = 0.3) -> None:
    """For synchronous tests (the console's browser pages)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
