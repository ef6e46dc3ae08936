"""Drive a send function with an arrival schedule and a concurrency cap; collect results."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tokenbus.infra.loadgen.arrivals import arrival_gaps
from tokenbus.infra.loadgen.results import RequestResult

P = TypeVar("P")
SendFn = Callable[[P], Awaitable[RequestResult]]


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, unless forced)."""

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def advance(self) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / max(self.total, 1))
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_load(
    send: SendFn,
    prompts: Sequence[P],
    rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every prompt on schedule; returns results in prompt order and the wall time."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(prompt: P) -> RequestResult:
        if gate is None:
            result = await send(prompt)
        else:
            async with gate:
                result = await send(prompt)
        if progress:
            progress.advance()
        return result

    start = time.perf_counter()
    tasks = []
    for prompt, gap in zip(prompts, arrival_gaps(len(prompts), rate, burstiness, seed)):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(prompt)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start
