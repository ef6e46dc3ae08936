"""The GPU consumer: pulls requests for one model, runs them through an engine with
continuous batching, and publishes token events and a Completion for each.

Flow control lives in Kafka: when ``max_num_seqs`` sequences are running the worker
pauses its partitions, so the backlog stays in the log (consumer lag is the queue
depth) and a crashed worker's queue is simply re-read by the next group member.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from gpu_consumers.engines import FINISH_ERROR, Engine, GenerationInput, StepOutput
from gpu_consumers.offsets import OffsetTracker
from gpu_consumers.settings import WorkerSettings
from producers import DeadLetterPublisher
from schemas import AvroCodec, ChatRequest, Completion, DecodeError, TokenEvent, now_ms
from topics import TopicCatalog, make_consumer, make_producer, topic_safe

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Running:
    request: ChatRequest
    tp: TopicPartition
    offset: int
    task: asyncio.Task[None] | None = None


class _CommitOnRevoke(ConsumerRebalanceListener):
    def __init__(self, worker: GpuWorker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker.commit()
        self._worker.offsets.forget(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._worker.ready.set()


class GpuWorker:
    def __init__(self, settings: WorkerSettings, engine: Engine, codec: AvroCodec | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.codec = codec or AvroCodec()
        self.catalog = TopicCatalog(settings.bus)
        self.offsets = OffsetTracker()
        self.ready = asyncio.Event()
        self.group_id = f"{settings.bus.topic_prefix}gpu.{topic_safe(settings.model)}"
        self._tier_rank = {self.catalog.requests(settings.model, t): i for i, t in enumerate(settings.bus.tiers)}
        self._running: dict[str, _Running] = {}
        self._slot_freed = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._dead_letters: DeadLetterPublisher | None = None
        self._stopping = asyncio.Event()
        self.completed = 0

    @property
    def running(self) -> int:
        return len(self._running)

    async def run(self) -> None:
        await self._start()
        try:
            await self._poll_loop()
        finally:
            await self._shutdown()

    def stop(self) -> None:
        self._stopping.set()

    async def _start(self) -> None:
        self._producer = make_producer(self.settings.bus)
        await self._producer.start()
        self._dead_letters = DeadLetterPublisher(self._producer, self.catalog)
        await self.engine.start()
        self._consumer = make_consumer(self.settings.bus, group_id=self.group_id)
        await self._consumer.start()
        self._consumer.subscribe(self.catalog.model_request_topics(self.settings.model), listener=_CommitOnRevoke(self))
        log.info("worker %s serving %s in group %s", self.settings.worker_id, self.settings.model, self.group_id)

    async def _shutdown(self) -> None:
        for running in list(self._running.values()):
            if running.task:
                running.task.cancel()
        await asyncio.gather(*(r.task for r in self._running.values() if r.task), return_exceptions=True)
        if self._consumer:
            await self.commit()
            await self._consumer.stop()
        await self.engine.close()
        if self._producer:
            await self._producer.stop()

    async def _poll_loop(self) -> None:
        assert self._consumer is not None
        loop = asyncio.get_running_loop()
        next_commit = loop.time()
        while not self._stopping.is_set():
            free = self.settings.max_num_seqs - len(self._running)
            self._apply_backpressure(free)
            if free <= 0:
                await self._wait_for_slot()
            else:
                batches = await self._consumer.getmany(timeout_ms=50, max_records=free)
                for tp in sorted(batches, key=lambda tp: self._tier_rank.get(tp.topic, len(self._tier_rank))):
                    for record in batches[tp]:
                        await self._admit(tp, record)
            if loop.time() >= next_commit:
                await self.commit()
                next_commit = loop.time() + self.settings.commit_interval_ms / 1000

    def _apply_backpressure(self, free: int) -> None:
        assert self._consumer is not None
        assigned = self._consumer.assignment()
        if free <= 0:
            self._consumer.pause(*assigned)
        elif self._consumer.paused():
            self._consumer.resume(*self._consumer.paused())

    async def _wait_for_slot(self) -> None:
        self._slot_freed.clear()
        try:
            await asyncio.wait_for(self._slot_freed.wait(), timeout=0.5)
        except TimeoutError:
            pass

    async def commit(self) -> None:
        if self._consumer is None:
            return
        owned = self._consumer.assignment()
        moves = {tp: off for tp, off in self.offsets.committable().items() if tp in owned}
        if not moves:
            return
        try:
            await self._consumer.commit({tp: OffsetAndMetadata(off, "") for tp, off in moves.items()})
            self.offsets.mark_committed(moves)
        except Exception as exc:  # a rebalance in progress; the next commit retries
            log.warning("offset commit failed: %s", exc)

    async def _admit(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        self.offsets.started(tp, record.offset)
        try:
            request = self.codec.decode(record.value, ChatRequest)
        except DecodeError as exc:
            assert self._dead_letters is not None
            await self._dead_letters.send(record, exc.reason, exc.detail)
            self.offsets.finished(tp, record.offset)
            return
        running = _Running(request, tp, record.offset)
        self._running[request.request_id] = running
        running.task = asyncio.create_task(self._serve(running), name=f"serve-{request.request_id}")

    async def _serve(self, running: _Running) -> None:
        request = running.request
        try:
            await self._generate(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("request %s failed", request.request_id)
        else:
            self.offsets.finished(running.tp, running.offset)
            self.completed += 1
        finally:
            self._running.pop(request.request_id, None)
            self._slot_freed.set()

    async def _generate(self, request: ChatRequest) -> None:
        assert self._producer is not None
        started = now_ms()
        deliveries: list[asyncio.Future] = []
        text: list[str] = []
        first_token_at: int | None = None
        last: StepOutput | None = None
        seq = 0
        async for out in self._outputs(request, started):
            if first_token_at is None and out.token_ids_diff:
                first_token_at = now_ms()
            text.append(out.text_diff)
            deliveries.append(await self._send_token(request, seq, out))
            seq += 1
            last = out
        assert last is not None
        completion = Completion(
            request_id=request.request_id,
            model=request.model,
            tier=request.tier,
            tenant=request.tenant,
            key_id=request.key_id,
            conversation_id=request.conversation_id,
            messages=request.messages,
            text="".join(text),
            finish_reason=last.finish_reason or FINISH_ERROR,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            error=last.error,
            worker_id=self.settings.worker_id,
            created_at_ms=request.created_at_ms,
            started_at_ms=started,
            first_token_at_ms=first_token_at,
            finished_at_ms=now_ms(),
        )
        deliveries.append(
            await self._producer.send(
                self.catalog.completions, self.codec.encode(completion), key=request.request_id.encode()
            )
        )
        await asyncio.gather(*deliveries)

    async def _send_token(self, request: ChatRequest, seq: int, out: StepOutput) -> asyncio.Future:
        assert self._producer is not None
        event = TokenEvent(
            request_id=request.request_id,
            seq=seq,
            text=out.text_diff,
            token_ids=list(out.token_ids_diff),
            finish_reason=out.finish_reason,
            error=out.error,
            prompt_tokens=out.prompt_tokens if out.finished else None,
            completion_tokens=out.completion_tokens if out.finished else None,
            worker_id=self.settings.worker_id,
        )
        return await self._producer.send(
            request.reply_topic,
            self.codec.encode(event),
            key=request.request_id.encode(),
            partition=request.reply_partition,
        )


    def _outputs(self, request: ChatRequest, started_ms: int) -> AsyncIterator[StepOutput]:
        if request.deadline_ms is not None and started_ms > request.deadline_ms:
            return _one(StepOutput("", (), 0, 0, FINISH_ERROR, "deadline passed while queued"))
        return _engine_outputs(self.engine, request)


async def _one(out: StepOutput) -> AsyncIterator[StepOutput]:
    yield out


async def _engine_outputs(engine: Engine, request: ChatRequest) -> AsyncIterator[StepOutput]:
    stream = engine.generate(GenerationInput.from_request(request))
    try:
        async for out in stream:
            yield out
    finally:
        stream.abort()  # a no-op once finished; stops the sequence if this worker is cancelled

