"""``tokenbus trace ID``: one chat turn's timeline, from the bus and the stores.

``ID`` is the completion id a client sees (``chatcmpl-...``, ``cmpl-...``: the request id; a response
of several choices, OpenAI's ``n``, has a request a choice, ``ID-0``, ``ID-1``, ...; a batch of the
Batch API a request a line, ``batch_...-0``, ...: its output file names each). The records of
the request are found on the bus and dated by their own fields or by the broker's timestamps
(CreateTime: set by the process that wrote them), then the transcript store's row and the
billing row, each with its write time:

    edge accepted        the ChatRequest's created_at
    ingress record       its record on requests.ingress (SDK publishers, an edge with route=ingress)
    moderation decision  the input decision's decided_at
    routed record        its record on requests.<model>.<tier>
    consumer admitted    the first token event's admitted_at (when the GPU consumer admitted it)
    first token          the first token event with tokens
    last token           the final token event
    completion           the Completion record
    transcript written   the reply's row in the transcript store
    billed               the usage row in ClickHouse

It reads every request topic to find the request (they are keyed by conversation), so on a long
log it takes a while: it is a tool for the embedded stack and for debugging, not a dashboard.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from aiokafka.structs import ConsumerRecord

from tokenbus.infra.admin.usage import DEFAULT_PROCESSORS_URL
from tokenbus.schemas import ChatRequest, Completion, DecodeError, ModerationDecision, TokenEvent
from tokenbus.stores.transcripts import TranscriptSettings, open_store
from tokenbus.topics import BusSettings, TopicCatalog, make_codec, make_consumer, topic_partitions

READ_IDLE_MS = 500


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    at_ms: int
    detail: str = ""


async def records(bus: BusSettings, topics: list[str], key: bytes | None = None) -> AsyncIterator[ConsumerRecord]:
    """Every record of ``topics`` (with ``key``, if given), from the start of their logs."""
    consumer = make_consumer(bus)
    await consumer.start()
    try:
        tps = await topic_partitions(consumer, *topics)
        if not tps:
            return
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while batches := await consumer.getmany(timeout_ms=READ_IDLE_MS):
            for batch in batches.values():
                for record in batch:
                    if key is None or record.key == key:
                        yield record
    finally:
        await consumer.stop()


async def bus_stages(bus: BusSettings, request_id: str) -> tuple[list[Stage], ChatRequest | None, Completion | None]:
    codec, catalog = make_codec(bus), TopicCatalog(bus)
    stages: list[Stage] = []
    request: ChatRequest | None = None
    routed_topics = [t for model in bus.models for t in catalog.model_request_topics(model)]
    async for record in records(bus, [catalog.ingress, *routed_topics]):
        try:
            found = codec.decode(record.value, ChatRequest)
        except DecodeError:
            continue
        if found.request_id != request_id:
            continue
        if request is None:
            request = found
            stages.append(Stage("edge accepted", found.created_at_ms, f"{found.model}, tier {found.tier}"))
        where = "ingress record" if record.topic == catalog.ingress else "routed record"
        placed = ""
        if "route" in found.annotations:  # KV-cache-aware placement's decision
            notes = found.annotations
            placed = f" (placed: {notes['route']}, {notes.get('route.hit_tokens', '0')} cached tokens" + (
                f" on {notes['route.worker']})" if "route.worker" in notes else ")")
        stages.append(Stage(where, record.timestamp, f"{record.topic}[{record.partition}]@{record.offset}{placed}"))
    key = request_id.encode()
    async for record in records(bus, [catalog.moderation], key):
        decision = codec.decode(record.value, ModerationDecision)
        stages.append(Stage(f"moderation decision ({decision.stage})", decision.decided_at_ms, decision.action))
    reply_log = request.reply_topic if request is not None else catalog.tokens
    tokens = [codec.decode(r.value, TokenEvent) async for r in records(bus, [reply_log], key)]
    first = next((e for e in tokens if e.seq == 0), None)
    if first is not None and first.admitted_at_ms is not None:
        stages.append(Stage("consumer admitted", first.admitted_at_ms, first.worker_id))
    generated = [e for e in tokens if e.token_ids]
    if generated:
        stages.append(Stage("first token", generated[0].created_at_ms, f"seq {generated[0].seq}"))
    final = next((e for e in tokens if e.is_final), None)
    if final is not None:
        stages.append(Stage("last token", final.created_at_ms, f"seq {final.seq}, {final.finish_reason}"))
    completion: Completion | None = None
    async for record in records(bus, [catalog.completions], key):
        completion = codec.decode(record.value, Completion)
        cached = f" ({completion.cached_prompt_tokens} cached)" if completion.cached_prompt_tokens else ""
        stages.append(Stage("completion", record.timestamp,
                            f"{completion.prompt_tokens}{cached} + {completion.completion_tokens} tokens"))
    return stages, request, completion


async def store_stages(completion: Completion, transcripts: TranscriptSettings, processors_url: str) -> list[Stage]:
    stages = []
    store = open_store(transcripts)
    try:
        conversation = completion.conversation_id or completion.continues_request_id or completion.request_id
        turn = completion.continues_request_id or completion.request_id
        page = await store.list_messages(completion.tenant, conversation, 500)
        rows = [m for m in page.items if m.request_id == turn and m.role == "assistant"]
        if rows and rows[0].written_at_ms:
            stages.append(Stage("transcript written", rows[0].written_at_ms, f"status {rows[0].status}"))
    finally:
        await store.close()
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(f"{processors_url}/usage", params={"request_id": completion.request_id})
        usage = response.json().get("rows", []) if response.status_code == 200 else []
    except httpx.HTTPError:
        usage = []
    if usage and usage[0].get("inserted_at"):
        billed = dt.datetime.fromisoformat(str(usage[0]["inserted_at"])).replace(tzinfo=dt.UTC)
        stages.append(Stage("billed", int(billed.timestamp() * 1000), f"{usage[0]['output_cost_nanousd']} nano-USD out"))
    return stages


async def trace(request_id: str, bus: BusSettings, transcripts: TranscriptSettings, processors_url: str) -> list[Stage]:
    """The turn's stages, in order of time (empty if the bus knows no such request)."""
    stages, _, completion = await bus_stages(bus, request_id)
    if completion is not None:
        stages += await store_stages(completion, transcripts, processors_url)
    return sorted(stages, key=lambda s: s.at_ms)


def render(stages: list[Stage]) -> str:
    start = stages[0].at_ms
    lines, previous = [], start
    for stage in stages:
        lines.append(f"{stage.at_ms - start:>9} ms  (+{stage.at_ms - previous:>6} ms)  {stage.name:<28} {stage.detail}")
        previous = stage.at_ms
    return "\n".join(lines)


def cmd_trace(args: argparse.Namespace) -> int:
    stages = asyncio.run(trace(args.request_id, BusSettings(), TranscriptSettings(), args.processors_url))
    if not stages:
        # A response of several choices (OpenAI's n, a batch of prompts) has no request of its own,
        # nor has a batch of the Batch API.
        each = "line by line" if args.request_id.startswith("batch_") else "choice by choice"
        print(f"no request {args.request_id} on the bus (a response of several choices, or a batch, is traced {each}: "
              f"{args.request_id}-0, {args.request_id}-1, ...)")
        return 1
    print(render(stages))
    return 0


def add_trace_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("trace", help="one chat turn's timeline, from the bus and the stores")
    parser.add_argument("request_id", help="the completion id a client sees (chatcmpl-... or cmpl-...; x-request-id)")
    parser.add_argument("--processors-url", default=DEFAULT_PROCESSORS_URL,
                        help="the processors' web address (billing rows, while they hold the embedded chDB)")
    parser.set_defaults(run=cmd_trace)
