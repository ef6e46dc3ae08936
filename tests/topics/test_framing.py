"""A bus with a schema registry (``TOKENBUS_SCHEMA_REGISTRY_URL``): every service frames its
records in Confluent's wire format and reads its peers'. The registry is the fake in
tests/fakes/schema_registry.py (none can be installed here; tests/schemas/test_registry.py runs
the client against a real one where one is named)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import fastavro
import pytest
from openai import AsyncOpenAI

from tests.conftest import MODEL, own_stack
from tests.fakes.schema_registry import FakeSchemaRegistry
from tests.gpu_consumers.helpers import read_all, running_worker
from tests.stream_processors.helpers import Processors, eventually, read_topic
from tests.waiting import wait_for
from tokenbus.infra.devstack.stack import EmbeddedStack
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import AvroCodec, ChatMessage, Completion, TokenEvent
from tokenbus.schemas.codec import CONFLUENT_HEADER_SIZE, SCHEMA_DIR
from tokenbus.stream_processors.context import ProcessorContext
from tokenbus.stream_processors.settings import ProcessorSettings
from tokenbus.topics import TopicCatalog, make_codec, make_producer

EVENT = TokenEvent("req-1", 0, "hi", [1])


@pytest.fixture(scope="module")
def registry() -> Iterator[FakeSchemaRegistry]:
    with FakeSchemaRegistry() as fake:
        yield fake


def framed_by(registry: FakeSchemaRegistry, data: bytes, subject: str) -> bool:
    return data[:CONFLUENT_HEADER_SIZE] == b"\x00" + registry.latest_id(subject).to_bytes(4, "big")


async def test_a_consumer_and_a_client_on_a_registry_s_bus_frame_alike(bus, registry):
    bus = bus.model_copy(update={"schema_registry_url": registry.url})
    async with (running_worker(bus, min_tokens=5, max_tokens=5) as worker,
                TokenbusClient(bus, idle_timeout=20) as client):
        request = client.new_request(MODEL, [ChatMessage("user", "framed?")])
        events = [reply.event async for reply in client.stream(request)]
        await wait_for(lambda: worker.completed == 1, 30, "the completion acknowledged")
    assert [e.seq for e in events] == list(range(5)) and events[-1].finish_reason == "stop"

    catalog = TopicCatalog(bus)
    requests = await read_all(bus, catalog.requests(MODEL, request.tier), expected=1)
    tokens = [r for r in await read_all(bus, catalog.tokens, expected=5) if r.key == request.request_id.encode()]
    [completion] = await read_all(bus, catalog.completions, expected=1)
    assert framed_by(registry, requests[0].value, "tokenbus.ChatRequest")
    assert all(framed_by(registry, r.value, "tokenbus.TokenEvent") for r in tokens)
    assert framed_by(registry, completion.value, "tokenbus.Completion")
    read = make_codec(bus).decode(completion.value, Completion)
    assert read.text == "".join(e.text for e in events) and read.completion_tokens == 5


def written_by_an_older_writer(registry: FakeSchemaRegistry, subject: str, history_file: str, datum: dict[str, Any]) -> bytes:
    """``datum`` framed as a writer on an older schema version writes it (the version registered
    as that writer registers it): an id the readers have not met."""
    schema = json.loads((SCHEMA_DIR / "history" / history_file).read_text())
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(schema), datum)  # the fields it lacks are left out
    return b"\x00" + registry.register(subject, schema).to_bytes(4, "big") + body.getvalue()


async def test_a_request_whose_schema_the_registry_cannot_give_yet_waits_and_is_served(bus):
    """Neither skipped nor dead-lettered: the consumer reads it again until its registry answers."""
    with FakeSchemaRegistry() as registry:
        bus = bus.model_copy(update={"schema_registry_url": registry.url})
        async with running_worker(bus) as worker, TokenbusClient(bus, idle_timeout=20) as client:
            request = client.new_request(MODEL, [ChatMessage("user", "from an older writer")])
            stream = client.router.open(request.request_id, request.reply_partition, request.reply_topic)
            registry.unavailable = True
            value = written_by_an_older_writer(registry, "tokenbus.ChatRequest", "chat_request.v3.avsc", request.to_avro())
            producer = make_producer(bus)
            await producer.start()
            try:
                await producer.send_and_wait(TopicCatalog(bus).requests(MODEL, request.tier), value,
                                             key=request.request_id.encode())
            finally:
                await producer.stop()
            await wait_for(lambda: len(registry.requests) > 2 and registry.requests[-1][1].startswith("/schemas/ids/"),
                           30, "the consumer asking for the request's schema")
            await asyncio.sleep(1.5)  # asked again and again meanwhile
            assert worker.completed == 0
            registry.unavailable = False
            events = [reply.event async for reply in stream.events(idle_timeout=30)]
        assert events[-1].finish_reason == "stop" and [e.seq for e in events] == list(range(len(events)))
        dead = await read_all(bus, TopicCatalog(bus).dlq, timeout=1)
        assert dead == []


async def test_token_events_whose_schema_the_registry_cannot_give_yet_wait_and_none_is_lost(bus):
    with FakeSchemaRegistry() as registry:
        bus = bus.model_copy(update={"schema_registry_url": registry.url})
        async with TokenbusClient(bus, reply_partitions=[5], idle_timeout=20) as client:
            request_id = f"req-{uuid.uuid4().hex}"
            stream = client.router.open(request_id, 5)
            registry.unavailable = True
            producer = make_producer(bus)
            await producer.start()
            try:
                for seq in range(4):
                    event = TokenEvent(request_id, seq, f" {seq}", [seq], finish_reason="stop" if seq == 3 else None)
                    value = written_by_an_older_writer(registry, "tokenbus.TokenEvent", "token_event.v4.avsc",
                                                       event.to_avro())
                    await producer.send_and_wait(TopicCatalog(bus).tokens, value, key=request_id.encode(), partition=5)
            finally:
                await producer.stop()
            await wait_for(lambda: any(p.startswith("/schemas/ids/") for _, p in registry.requests), 30,
                           "the router asking for the events' schema")
            await asyncio.sleep(1.5)
            registry.unavailable = False
            events = [reply.event async for reply in stream.events(idle_timeout=30)]
        assert [(e.seq, e.text) for e in events] == [(seq, f" {seq}") for seq in range(4)]


def test_the_topics_step_registers_the_schemas_for_services_that_only_look_them_up(bus):
    """`tokenbus topics`, the deployment step, registers the schemas; a service set not to
    register (``TOKENBUS_SCHEMA_REGISTRY_AUTO_REGISTER=false``) then starts with their ids."""
    with FakeSchemaRegistry() as registry:
        env = {**os.environ, "TOKENBUS_BOOTSTRAP_SERVERS": bus.bootstrap_servers, "TOKENBUS_TOPIC_PREFIX": bus.topic_prefix,
               "TOKENBUS_SCHEMA_REGISTRY_URL": registry.url}
        step = subprocess.run([sys.executable, "-m", "tokenbus.infra", "topics"], capture_output=True, text=True,
                              env=env, timeout=120)
        assert step.returncode == 0, step.stderr
        assert f"schema tokenbus.TokenEvent: id {registry.latest_id('tokenbus.TokenEvent')} in {registry.url}" in step.stdout
        looking_up = bus.model_copy(update={"schema_registry_url": registry.url, "schema_registry_auto_register": False})
        assert make_codec(looking_up).encode(EVENT)[:CONFLUENT_HEADER_SIZE] == \
            b"\x00" + registry.latest_id("tokenbus.TokenEvent").to_bytes(4, "big")


async def test_a_processor_waits_for_its_registry_rather_than_dead_lettering(bus):
    """A stream processor's record whose schema the registry cannot give yet is decoded once it
    answers: handled, not dead-lettered (the faust agents read through ``process``)."""
    with FakeSchemaRegistry() as registry:
        ctx = ProcessorContext(ProcessorSettings(bus=bus.model_copy(update={"schema_registry_url": registry.url})))
        handled: list[TokenEvent] = []

        async def handle(record: TokenEvent, message: Any) -> None:
            handled.append(record)

        try:
            registry.unavailable = True
            value = written_by_an_older_writer(registry, "tokenbus.TokenEvent", "token_event.v4.avsc", EVENT.to_avro())
            message = SimpleNamespace(topic="t", partition=0, offset=7, key=b"k", value=value, headers=[])
            processing = asyncio.create_task(ctx.process("moderate-output", message, TokenEvent, handle))
            await asyncio.sleep(1.0)
            assert not processing.done() and not handled
            registry.unavailable = False
            await asyncio.wait_for(processing, 30)
            assert handled == [EVENT]
            assert sum(s.value for s in ctx.metrics.dead_letters.collect()[0].samples if s.name.endswith("_total")) == 0
        finally:
            await ctx.stop()


@pytest.fixture(scope="module")
def framed_stack(stack, tmp_path_factory, registry) -> Iterator[EmbeddedStack]:
    env = {"TOKENBUS_SCHEMA_REGISTRY_URL": registry.url, "TOKENBUS_PROC_BILLING_BATCH_S": "0.2"}
    with own_stack(stack, tmp_path_factory.mktemp("framed"), [MODEL], env) as own:
        yield own


@pytest.mark.stack
async def test_a_whole_stack_on_a_registry_serves_bills_and_stores_a_turn(framed_stack, registry):
    """The edge, the GPU consumer and the stream processors (faust agents) of `make run`'s stack,
    each with the registry: a turn through the official client is served, billed in ClickHouse
    and its records on the bus are in Confluent's wire format."""
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    key = await framed_stack.create_key(tenant, "standard")
    openai = AsyncOpenAI(base_url=f"{framed_stack.edge_url}/v1", api_key=key, max_retries=0)
    reply = await openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}])
    assert reply.choices[0].message.content and reply.usage is not None

    rows = await eventually(lambda: Processors(framed_stack.processors_url).usage_rows(reply.id))
    assert [(r["tenant"], r["completion_tokens"]) for r in rows] == [(tenant, reply.usage.completion_tokens)]
    bus = framed_stack.bus_settings()
    completions = [r for r in await read_topic(bus, TopicCatalog(bus).completions) if r.key == reply.id.encode()]
    assert completions and all(framed_by(registry, r.value, "tokenbus.Completion") for r in completions)
    with pytest.raises(Exception, match="no_schema_registry"):  # a reader left without the setting is told
        AvroCodec().decode(completions[0].value, Completion)
    assert TokenEvent.schema_name in {path.split("/")[2] for _, path in registry.requests if path.startswith("/subjects/")}
