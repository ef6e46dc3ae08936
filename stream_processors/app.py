"""The faust app: one agent per job and input topic, a small web server for health,
metrics and usage reports, and a timer exporting each processor's consumer lag.

Agents stay thin (decode, hand to a handler, move on); the handlers live with their job
(``moderation/``, ``transcripts.py``, ``billing.py``, ``batches.py``) and know nothing of faust.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import faust
from aiokafka import ConsumerRecord
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread, Consumer, Transport
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenbus.moderation import Policy
from tokenbus.schemas import ChatRequest, Completion, TokenEvent
from tokenbus.stores.batches import BatchStore, may_be_batch_request
from tokenbus.stores.billing.clickhouse import UsageWriter
from tokenbus.stores.billing.prices import PriceTable
from tokenbus.stores.billing.report import UsageQuery, reconcile, request_usage, usage_report
from tokenbus.stores.redis_client import redis_client
from tokenbus.stores.transcripts import open_store
from tokenbus.stream_processors.batches import BatchOutcomes
from tokenbus.stream_processors.billing import ClickHouseSink
from tokenbus.stream_processors.context import ProcessorContext
from tokenbus.stream_processors.moderation.ingress import IngressModeration
from tokenbus.stream_processors.moderation.output import OutputModeration
from tokenbus.stream_processors.settings import ProcessorSettings
from tokenbus.stream_processors.transcripts import TranscriptWriter
from tokenbus.topics.catalog import TopicCatalog
from tokenbus.topics.clients import profile
from tokenbus.topics.holes import wait_at_holes
from tokenbus.topics.pacing import FetchPacer
from tokenbus.topics.rolled_logs import RolledLogReader

log = logging.getLogger(__name__)

RAW: dict[str, Any] = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
LAG_INTERVAL_S = 1.0
PACING_INTERVAL_S = 0.25
PAUSED_PACING_INTERVAL_S = 1.0  # while the pacer holds the fetching paused, a ring wakes it, not this


def tuned_transport(fetch_max_wait_ms: int, pacer: FetchPacer, fetcher_timeout_ms: int) -> type[Transport]:
    """faust hard-codes a 1.5 s fetch wait, and the embedded broker holds a fetch that finds no
    record for all of it (docs/architecture.md, the embedded broker): the ingress hop would add
    ~750 ms on average.
    This transport asks for ``fetch_max_wait_ms`` instead, hands the consumer to ``pacer``, and
    gives it the profile's ``fetcher_timeout_ms`` (topics/clients.py)."""

    class LowLatencyConsumerThread(AIOKafkaConsumerThread):
        def _create_worker_consumer(self, transport: Transport) -> Any:
            consumer = super()._create_worker_consumer(transport)
            consumer._fetch_max_wait_ms = fetch_max_wait_ms  # both read by AIOKafkaConsumer.start()
            consumer._consumer_timeout = fetcher_timeout_ms / 1000
            pacer.attach(consumer)  # in the consumer thread's event loop, where the pacer acts
            return consumer

        async def on_thread_stop(self) -> None:
            await pacer.close()
            await super().on_thread_stop()

    class LowLatencyConsumer(Consumer):
        def _new_consumer_thread(self) -> AIOKafkaConsumerThread:
            return LowLatencyConsumerThread(self, loop=self.loop, beacon=self.beacon)

    class LowLatencyTransport(Transport):
        Consumer = LowLatencyConsumer

    return LowLatencyTransport


def create_app(settings: ProcessorSettings | None = None) -> faust.App:
    settings = settings or ProcessorSettings()
    broker = f"kafka://{settings.bus.bootstrap_servers}"
    tuned = profile(settings.bus)
    state_dir: dict[str, Any] = {"datadir": str(settings.data_dir)} if settings.data_dir else {}
    app = faust.App(
        settings.group_id,
        broker=broker,
        store="memory://",
        autodiscover=False,
        topic_allow_declare=False,  # topics are provisioned with their partition counts (topics.ensure_topics)
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=tuned.session_timeout_ms / 1000,
        broker_heartbeat_interval=tuned.heartbeat_interval_ms / 1000,
        broker_commit_interval=0.5,
        producer_linger_ms=0,
        stream_wait_empty=False,
        web_enabled=True,
        web_bind=settings.host,
        web_port=settings.port,
        web_host=settings.host,
        **state_dir,
    )
    fetch_max_wait_ms = settings.fetch_max_wait_ms or tuned.fetch_max_wait_ms
    catalog = TopicCatalog(settings.bus)
    # Billing and transcripts need no 5 ms poll: fetched in spells (FetchPacer) while ingress, a
    # request path, keeps the short wait.
    pacer = FetchPacer(settings.bus, fetch_max_wait_ms, background_topics=(catalog.completions, catalog.moderation))
    transport = tuned_transport(fetch_max_wait_ms, pacer, tuned.fetcher_timeout_ms)
    if tuned.wait_at_holes:
        wait_at_holes()  # faust's consumers are not made by make_consumer
    app.transport = transport(app.conf.broker_consumer, app, loop=app.loop)
    ctx = ProcessorContext(settings)
    app.tokenbus = ctx  # type: ignore[attr-defined]
    policy = settings.moderation.load_policy()
    jobs = set(settings.jobs)
    if "moderation" in jobs:
        add_moderation(app, ctx, policy)
    if "transcripts" in jobs:
        add_transcripts(app, ctx, policy)
    sink = add_billing(app, ctx) if "billing" in jobs else None
    if "batches" in jobs:
        add_batches(app, ctx)
    add_pages(app, ctx, sink)
    add_lag_timer(app, ctx)
    add_fetch_pacing(app, ctx, pacer)

    @app.on_before_shutdown.connect  # type: ignore[arg-type]  # faust's signal types want a sync receiver
    async def close(app: faust.App, **kwargs: Any) -> None:
        await ctx.stop()

    return app


def topic(app: faust.App, name: str) -> faust.TopicT:
    return app.topic(name, **RAW)


def add_moderation(app: faust.App, ctx: ProcessorContext, policy: Policy) -> None:
    ingress = IngressModeration(ctx, policy)
    output = OutputModeration(ctx, policy)

    @app.agent(topic(app, ctx.catalog.ingress), name=ingress.name, concurrency=ctx.settings.ingress_concurrency)
    async def moderate_ingress(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await ctx.process(ingress.name, event.message, ChatRequest, ingress.handle)

    # One at a time: a stream's window needs its events in order.
    @app.agent(topic(app, ctx.catalog.tokens), name=output.name)
    async def moderate_output(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await ctx.process(output.name, event.message, TokenEvent, output.handle)

    if profile(ctx.settings.bus).roll_reply_logs:
        add_rolled_log_moderation(app, ctx, output)


def add_rolled_log_moderation(app: faust.App, ctx: ProcessorContext, output: OutputModeration) -> None:
    """On the embedded broker edges write their streams to rolled reply logs, topics that come and
    go, which a faust agent cannot follow: a reader of its own hands them to the same job, taking
    what writers hand over on the express lane too (a light GPU consumer's every event)."""

    async def moderate(record: ConsumerRecord) -> None:
        await ctx.process_record(output.name, record, TokenEvent, output.handle)

    def forget(log_name: str) -> None:
        for key in [key for key in ctx.positions if key[1] == log_name]:
            del ctx.positions[key]

    reader = RolledLogReader(ctx.settings.bus, f"{ctx.settings.group_id}.{output.name}", moderate,
                             name="moderate-rolled-logs", on_let_go=forget,
                             fetch_wait_ms=ctx.settings.output_moderation_fetch_wait_ms, express=True)

    @app.task
    async def moderate_rolled_logs() -> None:
        await reader.start()
        try:
            await asyncio.Event().wait()  # until the app stops
        finally:
            await reader.stop()


def add_transcripts(app: faust.App, ctx: ProcessorContext, policy: Policy) -> None:
    writer = TranscriptWriter(open_store(ctx.settings.transcripts), policy)

    @app.agent(topic(app, ctx.catalog.completions), name=writer.name)
    async def write_transcripts(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await ctx.process(writer.name, event.message, Completion, writer.handle)


def add_batches(app: faust.App, ctx: ProcessorContext) -> None:
    settings = ctx.settings
    client = redis_client(settings.redis_url, settings.redis_cluster)
    ctx.closing.append(client.aclose)
    outcomes = BatchOutcomes(BatchStore(client, settings.redis_prefix))

    @app.agent(topic(app, ctx.catalog.completions), name=outcomes.name)
    async def keep_batch_outcomes(stream: faust.StreamT) -> None:
        async for event in stream.events():
            # Most completions answer no batch: they pass by undecoded (billing and transcripts decode their own).
            if may_be_batch_request(event.message.key):
                await ctx.process(outcomes.name, event.message, Completion, outcomes.handle)
            else:
                ctx.passed(outcomes.name, event.message)


def add_billing(app: faust.App, ctx: ProcessorContext) -> ClickHouseSink:
    settings = ctx.settings
    prices = PriceTable.load(settings.prices_file)

    sink = ClickHouseSink(ctx, lambda: UsageWriter.open(settings.clickhouse, prices))
    size, within = settings.billing_batch_size, settings.billing_batch_s

    @app.task
    async def warm_billing() -> None:
        await sink.warm()

    @app.agent(topic(app, ctx.catalog.completions), name="bill-usage")
    async def bill_usage(stream: faust.StreamT) -> None:
        async for events in stream.take_events(size, within=within):  # type: ignore[attr-defined]  # not in StreamT
            await sink.bill([e.message for e in events])

    @app.agent(topic(app, ctx.catalog.moderation), name="store-decisions")
    async def store_decisions(stream: faust.StreamT) -> None:
        async for events in stream.take_events(size, within=within):  # type: ignore[attr-defined]  # not in StreamT
            await sink.store_decisions([e.message for e in events])

    return sink


def add_pages(app: faust.App, ctx: ProcessorContext, sink: ClickHouseSink | None) -> None:
    @app.page("/healthz")
    async def healthz(self: faust.web.View, request: faust.web.Request) -> faust.web.Response:
        body = {"status": "ok", "jobs": ctx.settings.jobs, "pid": os.getpid()}
        if sink is not None and not sink.warmed.is_set():  # ready once billing has its ClickHouse (or gave up)
            return self.json({**body, "status": "starting"}, status=503)
        return self.json(body)

    @app.page("/metrics")
    async def metrics(self: faust.web.View, request: faust.web.Request) -> faust.web.Response:
        return self.bytes(generate_latest(ctx.metrics.registry), content_type=CONTENT_TYPE_LATEST.split(";")[0])

    @app.page("/usage")
    async def usage(self: faust.web.View, request: faust.web.Request) -> faust.web.Response:
        """Usage reports for ``tokenbus usage`` where chDB's directory is this process's alone."""
        if sink is None:
            return self.json({"error": "this worker does not run the billing job"}, status=404)
        try:
            query = UsageQuery.from_params(dict(request.query))
        except ValueError as exc:
            return self.json({"error": str(exc)}, status=400)
        database = ctx.settings.clickhouse.database
        if request.query.get("check"):
            return self.json(await sink.call(lambda w: reconcile(w.client, database)))
        if request.query.get("request_id"):
            request_id = request.query["request_id"]
            return self.json(await sink.call(lambda w: request_usage(w.client, database, request_id)))
        return self.json(await sink.call(lambda w: usage_report(w.client, database, query)))


def add_fetch_pacing(app: faust.App, ctx: ProcessorContext, pacer: FetchPacer) -> None:
    """faust's fetch loop is its own: the pacer learns of traffic from the positions the
    processors reached, a few times a second (once a second while the stack is at rest), topic
    by topic (with input moderation in the edges, ingress is silent; with rolled reply logs,
    ``tokens`` is)."""

    @app.task
    async def pace_fetches() -> None:
        handled = dict(ctx.positions)
        while True:
            await asyncio.sleep(PAUSED_PACING_INTERVAL_S if pacer.paused else PACING_INTERVAL_S)
            now = dict(ctx.positions)
            moved = {key[1] for key, position in now.items() if handled.get(key) != position}
            pacer.observed(len(moved), moved)
            handled = now


def add_lag_timer(app: faust.App, ctx: ProcessorContext) -> None:
    @app.timer(LAG_INTERVAL_S)
    async def export_lag() -> None:
        """Lag = the partition's high-water mark (from fetch responses, right on every broker)
        minus the next offset the processor will handle."""
        for (processor, topic_name, partition), position in list(ctx.positions.items()):
            try:
                high = app.consumer.highwater(faust.types.TP(topic_name, partition))
            except Exception:
                continue
            if high is not None and high >= 0:
                ctx.metrics.lag.labels(processor, topic_name, str(partition)).set(max(0, high - position))
