"""The billing job: completions → ``usage_events`` and moderation decisions →
``moderation_decisions``, in batches by size and time. ClickHouse's client is
synchronous (chDB too), so writes run on one worker thread of their own."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenbus.schemas import Completion, DecodeError, ModerationDecision
from tokenbus.stores.billing.clickhouse import UsageWriter
from tokenbus.stream_processors.context import ProcessorContext, run_to_end
from tokenbus.topics import tracing

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R", bound=Completion | ModerationDecision)


class ClickHouseSink:
    def __init__(self, ctx: ProcessorContext, writer_factory: Callable[[], UsageWriter]) -> None:
        self.ctx = ctx
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clickhouse")
        self._writer_factory = writer_factory
        self._writer: UsageWriter | None = None
        self.warmed = asyncio.Event()  # set once ``warm`` has connected (or given up till the first batch)

    async def call(self, fn: Callable[[UsageWriter], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(self.writer()))

    def writer(self) -> UsageWriter:
        """Connected on first use, and again after a failure (ClickHouse may have been away)."""
        if self._writer is None:
            self._writer = self._writer_factory()
        return self._writer

    def reset(self) -> None:
        self._writer = None

    async def warm(self) -> None:
        """Connect at start rather than on the first batch: opening chDB, applying the schema and
        loading the prices take a few hundred milliseconds of CPU, which the first completions'
        billing, and whatever shares the machine with it, would otherwise pay."""
        try:
            await self.call(lambda writer: None)
        except Exception as exc:  # ClickHouse away: the first batch connects, and retries
            log.warning("billing: ClickHouse not connected at start (%s); the first batch tries again", exc)
            self.reset()
        finally:
            self.warmed.set()

    async def write_batch(self, processor: str, messages: Sequence[Any], record_type: type[R],
                          write: Callable[[UsageWriter, list[R]], int]) -> tuple[int, int]:
        """Returns how many records decoded and how many rows were written."""
        # Decode (dead-lettering what does not decode), then write until ClickHouse takes it.
        decoded: list[tuple[Any, R]] = []
        for message in messages:
            self.ctx.passed(processor, message)
            try:
                decoded.append((message, await self.ctx.decode_waiting_for_registry(processor, message, record_type)))
            except DecodeError as exc:
                await self.ctx.dead_letter(processor, message, exc.reason, exc.detail)
        if not decoded:
            return 0, 0
        turns = [parent for message, _ in decoded if (parent := tracing.from_record(message.headers))]
        with tracing.span(processor, kind=tracing.SpanKind.CONSUMER, links=turns) if turns else contextlib.nullcontext():
            return await self._write_batch(processor, decoded, write)

    async def _write_batch(self, processor: str, decoded: list[tuple[Any, R]],
                           write: Callable[[UsageWriter, list[R]], int]) -> tuple[int, int]:
        records = [record for _, record in decoded]
        started = time.perf_counter()
        try:
            written = await self.ctx.retrying(processor, lambda: self._write(records, write))
        except Exception:
            log.exception("%s: batch rejected; writing its records one by one", processor)
            written = await self._write_singly(processor, decoded, write)
        self.ctx.metrics.batch_seconds.labels(processor).observe(time.perf_counter() - started)
        self.ctx.metrics.processed(processor, len(records))
        return len(records), written

    async def _write_singly(self, processor: str, decoded: list[tuple[Any, Any]],
                            write: Callable[[UsageWriter, list], int]) -> int:
        """After ClickHouse refused a whole batch: find the records it refuses and dead-letter them."""
        written = 0
        for message, record in decoded:
            try:
                written += await self.ctx.retrying(processor, functools.partial(self._write, [record], write))
            except Exception as exc:
                await self.ctx.dead_letter(processor, message, "store_rejected", f"{type(exc).__name__}: {exc}")
        return written

    async def _write(self, records: list, write: Callable[[UsageWriter, list], int]) -> int:
        try:
            return await self.call(lambda w: write(w, records))
        except self.ctx.transient:
            self.reset()
            raise

    async def bill(self, messages: Sequence[Any]) -> None:
        decoded, written = await run_to_end(self.write_batch("bill-usage", messages, Completion, UsageWriter.write))
        self.ctx.metrics.usage_rows.inc(written)
        self.ctx.metrics.usage_duplicates.inc(decoded - written)

    async def store_decisions(self, messages: Sequence[Any]) -> None:
        await run_to_end(self.write_batch("store-decisions", messages, ModerationDecision, UsageWriter.write_decisions))
