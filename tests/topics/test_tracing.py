"""Traces across the bus: the trace context in record headers, and one chat turn's spans from
every service of a running stack, exported over OTLP/HTTP to a collector (a small receiver
here that decodes the real OTLP protobuf the services' exporters send)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import secrets
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.conftest import MODEL, own_stack
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import ChatMessage
from tokenbus.topics import TopicCatalog, tracing


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    links: tuple[str, ...]  # linked span ids
    events: tuple[str, ...]


class OtlpReceiver(http.server.ThreadingHTTPServer):
    """Accepts OTLP/HTTP trace exports (POST /v1/traces, protobuf) and keeps their spans."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404)
                    return
                receiver.keep(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def keep(self, export: ExportTraceServiceRequest) -> None:
        for resource_spans in export.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(ReceivedSpan(service, span.name, span.trace_id.hex(), span.span_id.hex(),
                                                   span.parent_span_id.hex(), tuple(link.span_id.hex() for link in span.links),
                                                   tuple(event.name for event in span.events)))


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.shutdown()


@contextlib.contextmanager
def tracing_to(endpoint: str | None) -> Iterator[None]:
    tracing.configure("tokenbus-test", endpoint)
    try:
        yield
    finally:
        tracing.configure("tokenbus-test", None)


def test_without_an_endpoint_records_carry_nothing_and_nothing_is_read():
    with tracing_to(None):
        with tracing.span("anything") as span:
            assert span is None
            assert tracing.record_headers() == []
        assert tracing.from_record([("traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")]) is None


def test_a_record_sent_inside_a_span_carries_it_to_the_next_service(collector):
    with tracing_to(collector.endpoint):
        assert tracing.record_headers() == []  # no current span: nothing to carry
        with tracing.span("sender") as sender:
            assert sender is not None
            headers = tracing.record_headers()
        assert [name for name, _ in headers] == ["traceparent"]
        with tracing.span("reader", tracing.from_record(headers)) as reader:
            assert reader is not None
            assert reader.get_span_context().trace_id == sender.get_span_context().trace_id
            assert reader.parent is not None and reader.parent.span_id == sender.get_span_context().span_id
        assert tracing.from_record([("other", b"x")]) is None
        with tracing.span("fresh", tracing.from_record({"traceparent": b"garbage"})) as fresh:
            assert fresh is not None and fresh.parent is None  # a bad header starts a new trace, never fails


@pytest.fixture(scope="module")
def traced_stack(stack, tmp_path_factory, collector) -> Iterator[EmbeddedStack]:
    """A stack of its own whose services export their spans to ``collector`` (tests tell their
    spans apart by trace id)."""
    env = {"TOKENBUS_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "TOKENBUS_PROC_BILLING_BATCH_S": "0.2"}
    with own_stack(stack, tmp_path_factory.mktemp("traced"), [MODEL], env) as own:
        yield own


@pytest.mark.stack
async def test_one_turn_is_one_trace_across_edge_consumer_and_processors(traced_stack, collector):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    async with httpx.AsyncClient(base_url=traced_stack.edge_url, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "trace me"}],
        }, headers={"Authorization": f"Bearer {traced_stack.dev_key}",
                    "traceparent": f"00-{trace_id}-{client_span}-01"}) as response:
            assert response.status_code == 200
            body = "".join([chunk async for chunk in response.aiter_text()])
    assert body.rstrip().endswith("data: [DONE]")

    def turn() -> dict[str, ReceivedSpan]:
        return {s.name: s for s in collector.spans if s.trace_id == trace_id}

    def billed() -> list[ReceivedSpan]:
        generate = turn().get("generate")
        return [s for s in collector.spans if s.name == "bill-usage" and generate and generate.span_id in s.links]

    for _ in range(300):
        if {"chat", "generate", "write-transcripts"} <= turn().keys() and billed():
            break
        await asyncio.sleep(0.1)
    spans = turn()
    assert set(spans) >= {"chat", "moderate-input", "generate", "write-transcripts"}, collector.spans
    chat, generate, transcript = spans["chat"], spans["generate"], spans["write-transcripts"]
    assert spans["moderate-input"].parent_span_id == chat.span_id  # the edge's own input moderation
    assert (chat.service, generate.service, transcript.service) == (
        "tokenbus-edge", "tokenbus-gpu-consumer", "tokenbus-processors")
    assert chat.parent_span_id == client_span  # the client's trace goes on at the edge
    assert generate.parent_span_id == chat.span_id  # through the request record
    assert transcript.parent_span_id == generate.span_id  # through the completion record
    assert "first token" in generate.events and "first event" in chat.events
    # Billing writes many turns at once: its span links to each turn's.
    assert [s.service for s in billed()] == ["tokenbus-processors"]


@pytest.mark.stack
async def test_an_internal_producer_s_trace_goes_on_through_input_moderation(traced_stack, collector):
    """A service publishing to `requests.ingress` inside its own span (the SDK sends the current
    context): input moderation continues the trace, and so does the record it routes."""
    bus = traced_stack.bus_settings()
    with tracing_to(collector.endpoint):
        async with TokenbusClient(bus, reply_partitions=[1], idle_timeout=30) as client:
            request = client.new_request(MODEL, [ChatMessage("user", "moderate and trace me")])
            with tracing.span("internal service") as caller:
                assert caller is not None
                stream = await client.submit(request, topic=TopicCatalog(bus).ingress)
            events = [reply.event async for reply in stream.events(idle_timeout=30)]
    assert events[-1].is_final and not events[-1].error
    trace_id, caller_span = f"{caller.get_span_context().trace_id:032x}", f"{caller.get_span_context().span_id:016x}"
    for _ in range(300):
        spans = {s.name: s for s in collector.spans if s.trace_id == trace_id}
        if {"internal service", "moderate-ingress", "generate"} <= spans.keys():
            break
        await asyncio.sleep(0.1)
    assert {"internal service", "moderate-ingress", "generate"} <= spans.keys(), collector.spans
    assert spans["moderate-ingress"].parent_span_id == caller_span
    assert spans["generate"].parent_span_id == spans["moderate-ingress"].span_id


@pytest.mark.stack
async def test_an_edge_stopped_with_sigterm_exports_its_last_spans(traced_stack, collector):
    """The batch exporter would send these minutes later; the edge exits (uvicorn re-raises
    SIGTERM, so no exit handler runs) only after sending them."""
    port = free_port()
    edge = await asyncio.to_thread(traced_stack.start_edge, "edge-stopping", port, "3",
                                   {"OTEL_BSP_SCHEDULE_DELAY": "600000", "TOKENBUS_EDGE_SHUTDOWN_GRACE_S": "1"})
    trace_id = secrets.token_hex(16)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        response = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "last words"}],
        }, headers={"Authorization": f"Bearer {traced_stack.dev_key}",
                    "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    assert response.status_code == 200
    edge.signal(signal.SIGTERM)
    assert edge.popen is not None
    await asyncio.to_thread(edge.popen.wait, 30)
    await asyncio.sleep(0.5)  # the receiver's thread files what it was sent
    assert [s.service for s in collector.spans if s.trace_id == trace_id and s.name == "chat"] == ["tokenbus-edge"]
