"""Scenario: what tracing costs a chat turn, in CPU, with tracing on and off.

In process, the calls each service makes for one turn (topics/tracing.py): the edge reads the
client's ``traceparent``, opens ``chat`` and ``moderate-input``, puts the context on the request record and closes the
span at the end of the stream; the GPU consumer reads it, opens ``generate``, marks the first
token and puts the context on the completion; the transcripts job reads it and opens its span.
With tracing on, spans go to a real batch exporter posting OTLP/HTTP to a local sink (its
thread's work is counted: process CPU time, not wall time). The same turn's Avro work (a request
encoded and decoded, a completion encoded and decoded) is timed beside it as the yardstick.
"""

from __future__ import annotations

import http.server
import os
import threading
import time
from typing import Any

from tokenbus.infra.devstack.processes import free_port
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, Completion
from tokenbus.topics import tracing

TURNS = 20_000
CLIENT_HEADERS = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def one_turn() -> None:
    # The edge.
    chat = tracing.start("chat", tracing.from_http(CLIENT_HEADERS), tracing.SpanKind.SERVER,
                         {"tokenbus.request_id": "r", "tokenbus.tenant": "t"})
    with tracing.current(chat):
        with tracing.span("moderate-input"):
            pass
        request_headers = tracing.record_headers()
    # The GPU consumer.
    with tracing.span("generate", tracing.from_record(request_headers), tracing.SpanKind.CONSUMER,
                      {"tokenbus.request_id": "r", "tokenbus.worker_id": "w"}):
        tracing.event("first token")
        completion_headers = tracing.record_headers()
    if chat is not None:
        chat.add_event("first event")
    tracing.end(chat)
    # The transcripts job.
    with tracing.span("write-transcripts", tracing.from_record(completion_headers), tracing.SpanKind.CONSUMER):
        pass


def cpu_us_per_turn(turns: int) -> float:
    started = time.process_time()
    for _ in range(turns):
        one_turn()
    return (time.process_time() - started) / turns * 1e6


def avro_us_per_turn(turns: int) -> float:
    codec = AvroCodec()
    request = ChatRequest("r", "tokenbus-sim", "standard", [ChatMessage("user", "hello there")], "tokens", 0)
    completion = Completion("r", "tokenbus-sim", "standard", "an answer of some words", "stop", 7, 32, 1, 2, 3)
    started = time.process_time()
    for _ in range(turns):
        codec.decode(codec.encode(request), ChatRequest)
        codec.decode(codec.encode(completion), Completion)
    return (time.process_time() - started) / turns * 1e6


def run() -> dict[str, Any]:
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")
    try:
        tracing.configure("bench", None)
        off = cpu_us_per_turn(TURNS)
        tracing.configure("bench", f"http://127.0.0.1:{sink.server_address[1]}")
        cpu_us_per_turn(1000)  # warm-up
        on = cpu_us_per_turn(TURNS)
        tracing.configure("bench", None)  # flushes what is left
    finally:
        sink.shutdown()
    avro = avro_us_per_turn(TURNS)
    return {"turns": TURNS, "tracing_off_us_per_turn": round(off, 2), "tracing_on_us_per_turn": round(on, 1),
            "avro_us_per_turn": round(avro, 1), "on_vs_avro": round(on / avro, 2)}


def table(result: dict[str, Any]) -> str:
    return "\n".join([
        "| tracing | CPU per turn | vs the turn's Avro work |", "|---|---:|---:|",
        f"| off | {result['tracing_off_us_per_turn']} µs | |",
        f"| on (5 spans, 2 record contexts, OTLP export) | {result['tracing_on_us_per_turn']} µs "
        f"| {result['on_vs_avro']}x |",
        f"| the turn's Avro work (request and completion, each encoded and decoded) | {result['avro_us_per_turn']} µs | 1x |",
    ]) + f"\n\n{result['turns']} turns in process, process CPU time"
