"""What every processor shares: the codec, the topic catalog, a producer for what they
emit, the dead-letter path, metrics, and the one rule for failures:

- a record that cannot be decoded, or that its processor rejects, goes to ``dlq`` with the
  reason in headers, and the stream moves on;
- a store or broker that is unavailable is retried with backoff until it answers, so the
  record is neither lost nor skipped (its offset is not committed meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenbus.producers import PrefixRouter, RequestPublisher
from tokenbus.schemas import DecodeError, Record, SchemaRegistryError
from tokenbus.stream_processors.metrics import ProcessorMetrics
from tokenbus.stream_processors.settings import ProcessorSettings
from tokenbus.topics import DeadLetterPublisher, RecordSender, TopicCatalog, make_codec, make_producer, tracing

log = logging.getLogger(__name__)
R = TypeVar("R")
RecordT = TypeVar("RecordT", bound=Record)


class Rejected(ValueError):
    """A record its processor cannot handle, ever: it goes to dlq with this reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def transient_errors() -> tuple[type[BaseException], ...]:
    """Failures of something outside the record (a store, the broker, the schema registry): retry,
    never dead-letter."""
    errors: list[type[BaseException]] = [OSError, KafkaError, sqlite3.OperationalError, TimeoutError,
                                         SchemaRegistryError, RedisConnectionError, RedisTimeoutError]
    try:
        from clickhouse_connect.driver.exceptions import OperationalError

        errors.append(OperationalError)
    except ImportError:
        pass
    return tuple(errors)


async def run_to_end(work: Awaitable[R]) -> R:
    """Await ``work`` to its end even when the caller is cancelled meanwhile, then pass the
    cancellation on. faust stops an agent by cancelling it and acks the event in hand as it
    goes, so a record cut off halfway would be committed as handled and never done again; run to
    its end, it is either done before the commit or, if the process is killed first, not committed."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():  # the work itself was cancelled
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class ProcessorContext:
    def __init__(self, settings: ProcessorSettings) -> None:
        self.settings = settings
        self.codec = make_codec(settings.bus)
        self.catalog = TopicCatalog(settings.bus)
        self.metrics = ProcessorMetrics()
        self.transient = transient_errors()
        self._producer: AIOKafkaProducer | None = None
        self._producer_lock = asyncio.Lock()
        self._sender: RecordSender | None = None
        self._publisher: RequestPublisher | None = None
        self._placement: PrefixRouter | None = None
        self._publisher_lock = asyncio.Lock()
        self.positions: dict[tuple[str, str, int], int] = {}  # (processor, topic, partition) -> next offset
        self.closing: list[Callable[[], Awaitable[None]]] = []  # what the jobs opened, closed on stop

    async def producer(self) -> AIOKafkaProducer:
        async with self._producer_lock:
            if self._producer is None:
                producer = make_producer(self.settings.bus)
                await producer.start()
                self._producer = producer
                self._sender = RecordSender(producer, self.codec, self.catalog)
        return self._producer

    async def stop(self) -> None:
        if self._placement is not None:
            await self._placement.stop()
        if self._producer is not None:
            await self._producer.stop()
        for close in self.closing:
            await close()

    async def sender(self) -> RecordSender:
        await self.producer()
        assert self._sender is not None
        return self._sender

    async def send(self, topic: str, record: Record, key: str, partition: int | None = None,
                   hand_over: bool = False) -> None:
        """Send ``record`` and wait for the broker's acknowledgement (then, with ``hand_over``, hand
        it to its readers on the express lane: ``RecordSender.send_and_wait``)."""
        await (await self.sender()).send_and_wait(topic, record, key, partition, hand_over)

    async def request_publisher(self) -> RequestPublisher:
        """For what the ingress processor forwards: placed by cache contents like the edge's requests."""
        async with self._publisher_lock:
            if self._publisher is None:
                if self.settings.bus.prefix_routing:
                    self._placement = PrefixRouter(self.settings.bus, self.codec)
                    await self._placement.start()
                self._publisher = RequestPublisher(await self.sender(), self._placement)
        return self._publisher

    async def dead_letter(self, processor: str, message: Any, reason: str, detail: str = "") -> None:
        self.metrics.dead_letters.labels(processor, reason).inc()
        await self.retrying(processor, lambda: self._dead_letter(message, reason, detail))

    async def _dead_letter(self, message: Any, reason: str, detail: str) -> None:
        await DeadLetterPublisher(await self.producer(), self.catalog).send(message, reason, detail)

    def decode(self, message: Any, record_type: type[RecordT]) -> RecordT:
        return self.codec.decode(message.value, record_type)

    async def decode_waiting_for_registry(self, processor: str, message: Any, record_type: type[RecordT]) -> RecordT:
        """``decode``, and where the schema registry did not give the record's schema (it did not
        answer), asked again until it does, as for any failure outside the record, which is neither
        skipped nor dead-lettered. A record that does not decode raises ``DecodeError``."""
        try:
            return self.decode(message, record_type)
        except SchemaRegistryError as exc:  # rare: a schema id met for the first time, and no answer
            async def decode() -> RecordT:
                return self.decode(message, record_type)

            return await self.retrying(processor, decode, failed=exc)

    async def retrying(self, processor: str, action: Callable[[], Awaitable[R]],
                       failed: BaseException | None = None) -> R:
        """Run ``action`` until it succeeds, backing off on transient failures; ``failed``: how a
        first try, made already, failed (it is tried again after the first back-off, not at once)."""
        delay = 0.05
        while True:
            if failed is not None:
                self.metrics.retries.labels(processor).inc()
                log.warning("%s: %s (%s); retrying in %.2fs", processor, type(failed).__name__, failed, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_delay_s)
            try:
                return await action()
            except self.transient as exc:
                failed = exc

    def passed(self, processor: str, message: Any) -> None:
        """``processor`` has read ``message`` (its lag counts from the next one)."""
        self.positions[(processor, message.topic, message.partition)] = message.offset + 1

    async def process(self, processor: str, message: Any, record_type: type[RecordT],
                      handle: Callable[[RecordT, Any], Awaitable[None]]) -> None:
        """A faust agent's record, as ``process_record``, and once begun processed to its end
        (``run_to_end``): faust acks the record in hand when it cancels an agent."""
        await run_to_end(self.process_record(processor, message, record_type, handle))

    async def process_record(self, processor: str, message: Any, record_type: type[RecordT],
                             handle: Callable[[RecordT, Any], Awaitable[None]]) -> None:
        """Decode one record and hand it to ``handle``; dead-letter what cannot be processed.
        As is for a reader that commits only the records it finished, so that one cut off is
        read again (topics/rolled_logs.py): a task and a shield per record (``run_to_end``)
        cost more than the rest of moderating a token event."""
        self.passed(processor, message)
        try:
            record = await self.decode_waiting_for_registry(processor, message, record_type)
        except DecodeError as exc:
            await self.dead_letter(processor, message, exc.reason, exc.detail)
            return
        # A record sent with a trace context (a request, a completion) gets a span of this job;
        # records it sends meanwhile (a routed request) carry it on. Token events carry none.
        parent = tracing.from_record(message.headers)
        traced = tracing.span(processor, parent, tracing.SpanKind.CONSUMER) if parent else contextlib.nullcontext()
        try:
            with traced:
                await self.retrying(processor, lambda: handle(record, message))
        except Rejected as exc:
            await self.dead_letter(processor, message, exc.reason, exc.detail)
            return
        except Exception as exc:  # a bug or a record no code path expected: never crash-loop on it
            log.exception("%s failed on %s/%s/%s", processor, message.topic, message.partition, message.offset)
            await self.dead_letter(processor, message, "processing_failed", f"{type(exc).__name__}: {exc}")
            return
        self.metrics.processed(processor)
