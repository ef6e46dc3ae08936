"""The GPU consumer: pulls requests for one model, runs them through an engine with
continuous batching, and publishes token events and a Completion for each.

Its requests come in through its intake (gpu_consumers/intake.py: fetches, flow control, the
express lane). Offsets are committed at the low-water mark of finished requests. A request that
may have been started elsewhere (fetched from before this worker's assignment) is first looked up
in the token log and continued after what was already published; so is one whose serving failed
here, served again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter, OrderedDict

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition

from tokenbus.gpu_consumers.control import ControlListener
from tokenbus.gpu_consumers.engines import (
    FINISH_CANCELLED,
    FINISH_CONTENT_FILTER,
    Engine,
    each_step,
)
from tokenbus.gpu_consumers.intake import RequestIntake
from tokenbus.gpu_consumers.metrics import WorkerMetrics
from tokenbus.gpu_consumers.offsets import OffsetTracker
from tokenbus.gpu_consumers.prefix_reports import PrefixReports
from tokenbus.gpu_consumers.refusals import Refusals
from tokenbus.gpu_consumers.scheduler import Pending, TierScheduler
from tokenbus.gpu_consumers.sequence import RunningSequence
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.gpu_consumers.step_events import StepEvents
from tokenbus.gpu_consumers.step_publisher import StepPass, StepPublisher
from tokenbus.gpu_consumers.token_log import Published, TokenLog
from tokenbus.schemas import AvroCodec, ChatRequest, CompletionBuilder, cancelled_group, group_of
from tokenbus.topics import (
    BatchingPublisher,
    DeadLetterPublisher,
    RecordSender,
    TopicCatalog,
    acknowledged,
    commit_as_member,
    make_codec,
    make_consumer,
    make_producer,
    tracing,
)

log = logging.getLogger(__name__)

CANCELLED_MEMORY = 100_000  # cancels remembered for requests not fetched yet
CANCELLED_GROUPS_MEMORY = 10_000  # cancelled groups (batches, responses of several choices) remembered
CANCELLED_REASONS = (FINISH_CANCELLED, FINISH_CONTENT_FILTER)
SERVE_AGAIN_FIRST_S = 0.5  # a failed request is served again after this, then after twice as long...
SERVE_AGAIN_TIMES = 5  # ...this many times (15.5 s in all); then it waits for redelivery


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: GpuWorker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker.release(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._worker.assigned(set(assigned))


class GpuWorker:
    def __init__(self, settings: WorkerSettings, engine: Engine, codec: AvroCodec | None = None,
                 metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.codec = codec or make_codec(settings.bus)
        self.catalog = TopicCatalog(settings.bus)
        self.metrics = metrics or WorkerMetrics(settings.model)
        self.offsets = OffsetTracker()
        self.scheduler = TierScheduler(settings.bus.tiers, settings.weight_of())
        self.token_log = TokenLog(settings.bus, self.codec, settings.takeover_clock_skew_ms)
        self.control = ControlListener(settings.bus, self.codec, self.cancel)
        self.ready = asyncio.Event()
        self.group_id = self.catalog.gpu_group(settings.model)
        self._running: dict[str, RunningSequence] = {}
        # Done in the engine, their slot given to the next request, their completion not yet
        # queued (a full batch of the producer's waits for the one before it to go out).
        self._finishing: dict[str, RunningSequence] = {}
        self._cancelled: OrderedDict[str, str] = OrderedDict()
        self._cancelled_groups: OrderedDict[str, str] = OrderedDict()
        self._tokens_in_flight = 0
        # Running sequences by the reply partition their events go to: a reader of one with few
        # streams (an edge, light) is handed their events over whatever else this worker runs.
        self._streams_to: Counter[tuple[str, int]] = Counter()
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._sender: RecordSender | None = None
        self._batches: BatchingPublisher | None = None
        self._prefix_reports: PrefixReports | None = None
        self._step_pass = StepPass()
        self._stopping = asyncio.Event()
        self._serving_again: dict[str, tuple[asyncio.TimerHandle, Pending]] = {}
        self.intake = RequestIntake(settings, self.codec, self.scheduler, self.offsets, self.token_log,
                                    in_flight=lambda: len(self._running) + self.scheduler.waiting(),
                                    taken=self._admit_waiting, stopping=self._stopping)
        self.completed = 0

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def partitions(self) -> int:
        return len(self._consumer.assignment()) if self._consumer else 0

    # -- lifecycle ---------------------------------------------------------------

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
        self._sender = RecordSender(self._producer, self.codec, self.catalog)
        self._batches = BatchingPublisher(self._producer, self.codec)
        await self.engine.start()
        prefix_cache = self.engine.prefix_cache  # set once the engine has started
        if self.settings.bus.prefix_routing and prefix_cache is not None:
            self._prefix_reports = PrefixReports(
                prefix_cache, self._sender, self.settings.worker_id, self.settings.model,
                lambda: (len(self._running), self.scheduler.waiting()),
                self.settings.cache_report_interval_ms, self.settings.cache_snapshot_interval_s)
            self._prefix_reports.start()
        await self.token_log.start()
        await self.control.start()
        self._consumer = make_consumer(self.settings.bus, group_id=self.group_id)
        await self._consumer.start()
        # What the producer knows of the reply logs' partitions: ``tokens``' from the start.
        await self._producer.partitions_for(self.catalog.tokens)
        refusals = Refusals(self.catalog, DeadLetterPublisher(self._producer, self.catalog), self._sender,
                            self.settings.worker_id, self._producer.client.cluster.partitions_for_topic,
                            self._producer.client.force_metadata_update,
                            self._cost, self.settings.max_tokens_in_flight)
        self.intake.start(self._consumer, refusals)
        self._consumer.subscribe(self.intake.topics, listener=_Rebalance(self))
        log.info("worker %s serving %s in group %s", self.settings.worker_id, self.settings.model, self.group_id)

    async def _shutdown(self) -> None:
        await self.intake.close()
        if self._consumer:
            await self.release(self._consumer.assignment())
            await self._consumer.stop()
        if self._prefix_reports is not None:
            await self._prefix_reports.stop()
        await self.control.stop()
        await self.token_log.stop()
        await self.engine.close()
        if self._producer:
            await self._producer.stop()

    # -- partitions --------------------------------------------------------------

    def assigned(self, partitions: set[TopicPartition]) -> None:
        self.intake.assigned(partitions)
        if self._prefix_reports is not None and self._consumer is not None:
            self._prefix_reports.owned(self._consumer.assignment() | partitions)
        self.ready.set()

    async def release(self, partitions: set[TopicPartition]) -> None:
        """Give partitions back: drop what waits, stop what runs without a final event, make
        every token published so far durable, and commit. The next owner continues from the log."""
        self.intake.releasing(partitions)
        for pending in self.scheduler.remove_partitions(partitions):
            if pending.published is not None:
                pending.published.cancel()
        for request_id, (timer, pending) in list(self._serving_again.items()):
            if pending.tp in partitions:  # uncommitted: the next owner serves it
                timer.cancel()
                del self._serving_again[request_id]
        stopping = [r.task for r in (*self._running.values(), *self._finishing.values())
                    if r.pending.tp in partitions and r.task is not None]
        for task in stopping:
            task.cancel()
        await asyncio.gather(*stopping, return_exceptions=True)
        if self._batches:
            await self._batches.flush()
        if self._producer:
            await self._producer.flush()
        await self.commit()
        self.offsets.forget(partitions)
        self.intake.released(partitions)
        if self._prefix_reports is not None and self._consumer is not None:
            self._prefix_reports.owned(self._consumer.assignment() - partitions)

    async def commit(self) -> None:
        if self._consumer is None:
            return
        owned = self._consumer.assignment()
        moves = {tp: off for tp, off in self.offsets.committable().items() if tp in owned}
        if not moves:
            return
        try:
            if await commit_as_member(self._consumer, moves):
                self.offsets.mark_committed(moves)
            else:  # the group forgot this worker: its partitions are lost, not revoked, and others' to commit
                log.info("offsets not committed: no longer a member of %s", self.group_id)
        except Exception as exc:  # a rebalance in progress, the broker away; the next commit retries
            log.warning("offset commit failed: %s", exc)

    # -- admission -------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_commit = loop.time()
        while not self._stopping.is_set():
            if await self.intake.fetch() and self._prefix_reports is not None:
                self._prefix_reports.load_changed()
            self._admit_waiting()
            self.metrics.occupancy(len(self._running), self.scheduler.waiting(), self.settings.max_num_seqs)
            self.metrics.kv_cache(self.engine.kv_cache_usage())
            if loop.time() >= next_commit:
                await self.commit()
                next_commit = loop.time() + self.settings.commit_interval_ms / 1000

    def _cost(self, request: ChatRequest) -> int:
        return request.estimated_prompt_tokens + (request.max_tokens or self.settings.default_max_tokens)

    def _admit_waiting(self) -> None:
        while len(self._running) < self.settings.max_num_seqs:
            pending = self.scheduler.peek()
            if pending is None:
                return
            cost = self._cost(pending.request)
            if self._running and self._tokens_in_flight + cost > self.settings.max_tokens_in_flight:
                return
            self.scheduler.pop()
            self._launch(pending, cost)

    def _launch(self, pending: Pending, cost: int) -> None:
        running = RunningSequence(pending, cost)
        request_id = pending.request.request_id
        reason = self._cancelled.get(request_id)
        if reason is None and self._cancelled_groups:
            reason = self._cancelled_groups.get(group_of(request_id) or "")
        if reason is not None:
            running.cancel(reason)
        self._running[request_id] = running
        self._tokens_in_flight += cost
        self._streams_to[reply_to(pending.request)] += 1
        self.metrics.queued(time.time() - pending.request.created_at_ms / 1000)
        running.task = asyncio.create_task(self._serve(running), name=f"serve-{request_id}")

    # -- cancellation --------------------------------------------------------------

    def cancel(self, request_id: str, reason: str = "") -> None:
        """A cancel from `control`: abort within one engine step, or answer a waiting request at once."""
        group = cancelled_group(request_id)
        if group is not None:
            self._cancel_group(group, reason)
            return
        running = self._running.get(request_id)
        if running is not None:
            running.cancel(reason)
            return
        waiting = self.scheduler.remove(request_id)
        if waiting is not None:
            self._launch(waiting, 0)
            self._running[request_id].cancel(reason)
            return
        self._cancelled[request_id] = reason
        while len(self._cancelled) > CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)

    def _cancel_group(self, group: str, reason: str) -> None:
        """Cancel every request ``{group}-{n}``: those running and waiting now, and those fetched later."""
        for request_id, running in list(self._running.items()):  # (a cancel may end one at once)
            if group_of(request_id) == group:
                running.cancel(reason)
        for waiting in self.scheduler.remove_where(lambda p: group_of(p.request.request_id) == group):
            self._launch(waiting, 0)
            self._running[waiting.request.request_id].cancel(reason)
        self._cancelled_groups[group] = reason
        while len(self._cancelled_groups) > CANCELLED_GROUPS_MEMORY:
            self._cancelled_groups.popitem(last=False)

    # -- serving one request ---------------------------------------------------------

    async def _serve(self, running: RunningSequence) -> None:
        pending = running.pending
        attributes = {"tokenbus.request_id": pending.request.request_id, "tokenbus.worker_id": self.settings.worker_id}
        # The completion, sent inside the span, carries its context on to the processors.
        with tracing.span("generate", pending.trace, tracing.SpanKind.CONSUMER, attributes):
            await self._serve_in_span(running)

    async def _serve_in_span(self, running: RunningSequence) -> None:
        pending = running.pending
        request = pending.request
        log.debug("admitted %s (%d running)", request.request_id, len(self._running))
        try:
            published = await pending.published if pending.published is not None else Published()
            if published.final is not None:
                deliveries = [await self._publish_completion(request, CompletionBuilder(published.events))]
            else:
                if published.events:
                    self.metrics.taken_over()
                    log.info("continuing %s after seq %d", request.request_id, published.next_seq - 1)
                deliveries = await self._generate(running, published)
            # The engine is done with it: its slot goes to the next request while the acks arrive.
            self._release_slot(running)
            await acknowledged(deliveries)
        except asyncio.CancelledError:
            # Partition released or shutting down before the request finished: the next owner
            # continues from the log, or finds the final event there and writes the completion again.
            raise
        except Exception:
            if pending.failures >= SERVE_AGAIN_TIMES:
                log.exception("request %s failed %d times; it stays uncommitted until it is redelivered",
                              request.request_id, pending.failures + 1)
            else:
                delay = SERVE_AGAIN_FIRST_S * 2 ** pending.failures
                log.exception("request %s failed; served again in %.1f s, after what the log holds of it",
                              request.request_id, delay)
                self._serve_again_later(pending, delay)
        else:
            self.offsets.finished(pending.tp, pending.offset)
            self.completed += 1
        finally:
            self._release_slot(running)

    def _serve_again_later(self, pending: Pending, delay: float) -> None:
        """A request whose serving failed (a write the broker refused, a token-log scan that timed
        out) is served again here, as a takeover of itself: what it published is read back and it
        goes on after that. Left uncommitted for redelivery, it would wait for the next rebalance,
        and its completion, which bills it, with it. A request that keeps failing (its reply log
        deleted, say: the embedded broker refuses writes to it) is left to redelivery after a few
        tries; each try may write its completion again, which billing counts once."""
        request_id = pending.request.request_id
        again = dataclasses.replace(pending, published=None, failures=pending.failures + 1)
        timer = asyncio.get_running_loop().call_later(delay, self._serve_again, again)
        self._serving_again[request_id] = (timer, again)

    def _serve_again(self, pending: Pending) -> None:
        self._serving_again.pop(pending.request.request_id, None)
        if self._stopping.is_set():
            return
        pending.published = self.token_log.lookup(pending.request)
        self.scheduler.add(pending)
        self._admit_waiting()

    def _release_slot(self, running: RunningSequence) -> None:
        """The engine is done with ``running``: its slot goes to the next request."""
        request_id = running.pending.request.request_id
        if self._running.get(request_id) is not running:
            return
        del self._running[request_id]
        self._cancelled.pop(request_id, None)
        self._tokens_in_flight -= running.cost
        target = reply_to(running.pending.request)
        self._streams_to[target] -= 1
        if not self._streams_to[target]:
            del self._streams_to[target]
        if not self._stopping.is_set():
            self._admit_waiting()
        self.metrics.occupancy(len(self._running), self.scheduler.waiting(), self.settings.max_num_seqs)
        if self._prefix_reports is not None:
            self._prefix_reports.load_changed()

    async def _generate(self, running: RunningSequence, published: Published) -> list[asyncio.Future]:
        """Run the engine and publish each step; returns the deliveries still to be acknowledged."""
        request = running.pending.request
        assert self._batches is not None
        events = StepEvents(request, self.settings.worker_id, self.settings.tool_parser, published,
                            running.admitted_at_ms)
        target = reply_to(request)
        steps = StepPublisher(running, published, events, self._batches, self.metrics, self._step_pass,
                              self.settings.stream_interval_ms / 1000, lambda: self._streams_to[target])
        await running.prepare(self.engine, published)  # the prompt tokenized in a thread, for one
        outputs = running.outputs(self.engine, published)
        if self._prefix_reports is not None and running.stream is not None:  # the engine has the prompt
            self._prefix_reports.admitted(request, running.engine_input)
        try:
            await each_step(outputs, steps)
        finally:
            running.stop()
        steps.finish()
        turn, deliveries = steps.turn, steps.deliveries
        final = turn.last
        assert final is not None  # an engine's stream ends with a final step
        if final.finish_reason in CANCELLED_REASONS:
            self.metrics.aborted()
        if final.prompt_tokens:
            self.metrics.prompt(final.prompt_tokens, final.cached_tokens or 0)
        # The next request need not wait for the completion to be queued: one sent through the
        # producer's ``send`` (the first, before the producer knows the topic) may wait for a
        # metadata round trip or a full batch. A release waits for it meanwhile (``_finishing``).
        self._finishing[request.request_id] = running
        self._release_slot(running)
        try:
            deliveries.append(await self._publish_completion(request, turn))
        finally:
            self._finishing.pop(request.request_id, None)
        return deliveries

    async def _publish_completion(self, request: ChatRequest, turn: CompletionBuilder) -> asyncio.Future:
        completion = turn.build(request, self.settings.worker_id)
        self.metrics.finished(completion.finish_reason)
        assert self._sender is not None and self._batches is not None
        # With the token events of the pass: when a wave of sequences ends in one step, its
        # completions go out as one batch a partition. Where the sender is needed (the producer
        # has no metadata for the topic yet), it fetches it.
        batched = self._batches.publish_keyed(self.catalog.completions, request.request_id, completion,
                                              tracing.record_headers())
        if batched is not None:
            return batched
        queued = asyncio.ensure_future(self._sender.send(self.catalog.completions, completion, request.request_id))
        try:
            return await asyncio.shield(queued)
        except asyncio.CancelledError:
            # Released or stopping after the final event, while the send waited (a metadata round
            # trip, for a topic this producer has not written lately): it is queued all the same,
            # so the flush that follows writes it, and the turn is billed without its next owner.
            with contextlib.suppress(Exception):
                await queued
            raise


def reply_to(request: ChatRequest) -> tuple[str, int]:
    """Where a request's token events go: its reply topic and partition."""
    return request.reply_topic, request.reply_partition
