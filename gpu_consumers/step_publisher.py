"""One request's engine steps on their way out: made into token events (step_events.py),
published with the rest of the engine step (topics/batching.py), added to the turn its
completion is built from, and counted.

A plain function takes each step (``StepPublisher`` is a sink for ``each_step``), so an engine
that pushes its steps calls it where it hands a step over and no task wakes per token. What it
takes is published at the end of the event loop's pass (``StepPass``): the steps a sequence made
meanwhile go out as one event, as a reader that fell behind its engine would merge them (vLLM's
output collector does the same), so a busy consumer spends less per token rather than more.
Steps within the stream interval wait for the next. A publisher runs outside its request's
task: it marks the first token on the span it was made in."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from tokenbus.gpu_consumers.engines import FINISH_CANCELLED, StepOutput
from tokenbus.gpu_consumers.metrics import WorkerMetrics
from tokenbus.gpu_consumers.sequence import RunningSequence
from tokenbus.gpu_consumers.step_events import StepEvents
from tokenbus.gpu_consumers.token_log import Published
from tokenbus.schemas import CompletionBuilder
from tokenbus.topics import BatchingPublisher, FetchPacer, tracing

log = logging.getLogger(__name__)


class StepPass:
    """The publishers that took steps during this pass of the event loop; each publishes once,
    when the pass's ready callbacks have run (one ``call_soon`` for them all)."""

    def __init__(self) -> None:
        self._due: list[StepPublisher] = []

    def add(self, publisher: StepPublisher) -> None:
        if not self._due:
            asyncio.get_running_loop().call_soon(self._publish)
        self._due.append(publisher)

    def _publish(self) -> None:
        due, self._due = self._due, []
        for publisher in due:
            publisher.publish_held()


class StepPublisher:
    def __init__(self, running: RunningSequence, published: Published, events: StepEvents,
                 batches: BatchingPublisher, metrics: WorkerMetrics, step_pass: StepPass, interval_s: float,
                 streams_beside: Callable[[], int]) -> None:
        request = running.pending.request
        self.turn = CompletionBuilder(published.events)  # not the events: a turn holds hundreds
        self.deliveries: list[asyncio.Future[None]] = []  # those still to be acknowledged
        self._running = running
        self._events = events
        self._publish = batches.publish
        self._target = (request.reply_topic, request.reply_partition, request.request_id)
        self._metrics = metrics
        self._pass = step_pass
        self._interval = interval_s
        self._streams_beside = streams_beside  # running sequences whose events go where this one's do
        self._created_s = request.created_at_ms / 1000
        self._continuing = bool(published.events)  # taken over: its first token came from elsewhere
        self._span = tracing.current_span()
        self._held: StepOutput | None = None  # taken, not published yet
        self._due = False  # in this pass's StepPass
        self._failure: Exception | None = None
        self._last_sent: float | None = None

    def __call__(self, out: StepOutput) -> None:
        if self._failure is not None:
            return
        if out.finish_reason == FINISH_CANCELLED:
            out = dataclasses.replace(out, finish_reason=self._running.stop_reason)
        held = self._held
        self._held = out if held is None else held.followed_by(out)
        if not self._due:
            self._due = True
            self._pass.add(self)

    def finish(self) -> None:
        """After the final step: publish what is held, or raise what stopped publishing."""
        self.publish_held()
        if self._failure is not None:
            raise self._failure

    def publish_held(self) -> None:
        self._due = False
        out, last_sent = self._held, self._last_sent
        if out is None or self._failure is not None:
            return
        if self._interval and last_sent is not None and not out.finished and time.time() - last_sent < self._interval:
            return  # published with the step that comes after the interval, or the final
        self._held = None
        try:
            self._publish_step(out, last_sent)
        except Exception as exc:  # this request's own failure (its text would not encode, say): it
            self._failure = exc   # is served again; the others in the pass are not held up by it
            self._running.stop()
            log.warning("request %s: a step could not be published: %s", self._target[2], exc)

    def _publish_step(self, out: StepOutput, last_sent: float | None) -> None:
        event = self._events.event(self.turn.count, out)
        deliveries = self.deliveries
        # While few streams go to its reply partition, each event is handed to their reader (an
        # edge) as soon as it is acknowledged (topics/doorbell.py): the first is what the client
        # waits for, and with every one on the lane the edge's fetches only back it up, at a longer
        # wait (FetchPacer). Under load fetches return records at once, and a hand-over only adds
        # work. Counted by partition, not for the whole worker: a light edge keeps its lane while
        # another edge loads the same worker.
        delivery = self._publish(*self._target, event, self._streams_beside() <= FetchPacer.LIGHT_IN_FLIGHT)
        if not deliveries or deliveries[-1] is not delivery:  # steps of one engine step share one
            deliveries.append(delivery)
        self.turn.add(event)
        if out.token_ids_diff:
            sent = time.time()
            self._metrics.tokens(len(out.token_ids_diff))
            if last_sent is None and not self._continuing:
                self._metrics.first_token(sent - self._created_s)
                tracing.event("first token", self._span)
            elif last_sent is not None:
                self._metrics.token_gap(sent - last_sent)
            self._last_sent = sent
