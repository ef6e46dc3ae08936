"""Traces across the bus: one chat turn is one OpenTelemetry trace, from the edge through the
GPU consumer to the stream processors.

The W3C trace context (``traceparent``, ``tracestate``) travels in Kafka record headers: a
record sent while a span is current carries it (``RecordSender`` adds ``record_headers()``), and
a service that reads a record carrying one continues that trace (``from_record``). Spans go out
over OTLP/HTTP where ``TOKENBUS_OTLP_ENDPOINT`` is set (``configure``, once per process);
elsewhere nothing is recorded, nothing is added to records, and every call here costs a flag
check. Token events carry no context (hundreds per turn): the GPU consumer's span covers them.

Spans: the edge's ``chat`` (SERVER, child of the client's ``traceparent`` when it sends one,
from the request to the end of its stream, with the edge's ``moderate-input`` inside), the GPU
consumer's ``generate`` (CONSUMER, from admission to the completion record, with a ``first
token`` event), and one per processor job that handles a record carrying a context
(``moderate-ingress``, ``write-transcripts``). Billing writes batches of many turns: its
``bill-usage`` span is a root linked to each turn's span. Where no collector runs,
`tokenbus trace ID` reconstructs a turn from the bus and the stores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["Context", "Span", "SpanKind", "configure", "current", "current_span", "end", "enabled", "event", "flush",
           "from_http", "from_record", "record_headers", "span", "start"]

_PROPAGATOR = TraceContextTextMapPropagator()
_FIELDS = frozenset(_PROPAGATOR.fields)  # traceparent, tracestate
_tracer: trace.Tracer | None = None
_provider: Any = None  # the SDK's TracerProvider, where tracing is on


def configure(service: str, endpoint: str | None) -> None:
    """Export this process's spans to the OTLP/HTTP collector at ``endpoint`` (its base address,
    e.g. ``http://collector:4318``); None turns tracing off. The batch exporter's own
    ``OTEL_BSP_*`` and ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeouts) apply. Spans not yet
    exported go out at exit, or when tracing is configured again."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None
    if not endpoint:
        return
    # The SDK is imported only where tracing is on.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))  # flushed at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")))
    _tracer, _provider = provider.get_tracer("tokenbus"), provider


def flush() -> None:
    """Export the spans not yet exported (a process about to exit without running exit handlers)."""
    if _provider is not None:
        _provider.force_flush()


def enabled() -> bool:
    return _tracer is not None


def from_http(headers: Mapping[str, str]) -> Context | None:
    """The caller's trace context from a request's ``traceparent`` header, if it sent one."""
    if _tracer is None or "traceparent" not in headers:
        return None
    return _PROPAGATOR.extract({name: headers[name] for name in _FIELDS if name in headers})


def from_record(headers: Sequence[tuple[str, bytes]] | Mapping[str, bytes] | None) -> Context | None:
    """The trace context a record was sent with, if any."""
    if _tracer is None or not headers:
        return None
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    carrier = {name: value.decode("latin-1") for name, value in pairs if name in _FIELDS and value}
    return _PROPAGATOR.extract(carrier) if "traceparent" in carrier else None


def record_headers() -> list[tuple[str, bytes]]:
    """The current span's trace context, as Kafka record headers (none without a current span)."""
    if _tracer is None:
        return []
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return [(name, value.encode("latin-1")) for name, value in carrier.items()]


def current_span() -> Span | None:
    """The span current here (None where tracing is off), for marking moments on it from code
    that runs elsewhere: a step an engine pushes is published outside its request's task."""
    return trace.get_current_span() if _tracer is not None else None


def event(name: str, span: Span | None = None) -> None:
    """Mark a moment (the first token) on ``span``, or on the current span."""
    if _tracer is not None:
        (span or trace.get_current_span()).add_event(name)


def start(name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
          attributes: Mapping[str, Any] | None = None, links: Sequence[Context] = ()) -> Span | None:
    """A span that outlives the code that starts it (a stream); end it with ``end``. ``links``:
    the traces a span works for besides its parent's (a batch of many turns' records)."""
    if _tracer is None:
        return None
    linked = [Link(trace.get_current_span(context).get_span_context()) for context in links]
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes, links=linked)


def end(span: Span | None, error: BaseException | None = None) -> None:
    if span is None:
        return
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
    span.end()


_NOTHING: contextlib.nullcontext[None] = contextlib.nullcontext()  # tracing off: no generator per call


def current(span: Span | None) -> contextlib.AbstractContextManager[Any]:
    """``span`` is the current span inside the block (records sent there carry its context)."""
    if span is None:
        return _NOTHING
    return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def span(name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, Any] | None = None,
         links: Sequence[Context] = ()) -> contextlib.AbstractContextManager[Span | None]:
    """A span around the block, current inside it, ended (with the error, if one escapes) after."""
    if _tracer is None:
        return _NOTHING
    return _span(name, parent, kind, attributes, links)


@contextlib.contextmanager
def _span(name: str, parent: Context | None, kind: SpanKind, attributes: Mapping[str, Any] | None,
          links: Sequence[Context]) -> Iterator[Span | None]:
    started = start(name, parent, kind, attributes, links)
    try:
        with current(started):
            yield started
    except BaseException as exc:
        end(started, exc)
        raise
    end(started)
