"""Output moderation's reaction time: how long after the token event that completes a blocked
phrase its truncation is in the stream's log, and how many token events the GPU consumer wrote in
between (what a client may see past the phrase before the cut). Both times are the records' own
timestamps, each set by the process that wrote it, so the figure is the moderation hop's alone.

Streams one at a time (`TOKENBUS_BENCH_TRUNCATION_STREAMS`, 20), on the tier whose policy blocks
the phrase, each with a seed whose simulated output utters it between its 30th and 150th token
(10 ms a token)."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from aiokafka import TopicPartition

from bench.stack import MODEL, bench_stack
from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams, SimulatedEngine, SimulatedEngineSettings
from tokenbus.moderation.policy import DEFAULT_POLICY_FILE
from tokenbus.schemas import AvroCodec, ChatMessage, TokenEvent
from tokenbus.topics import TopicCatalog
from tokenbus.topics.clients import make_consumer

PHRASE = "the edge"  # which the simulated engine says now and then
TIER = "interactive"
POLICY = DEFAULT_POLICY_FILE.read_text() + f"""
[categories.bench_phrase]
phrases = ["{PHRASE}"]

[output_actions.{TIER}]
bench_phrase = "block"
"""
SIM = SimulatedEngineSettings(seed=3, ttft_ms=20, tokens_per_s=100, min_tokens=300, max_tokens=300)
STREAMS = int(os.environ.get("TOKENBUS_BENCH_TRUNCATION_STREAMS", "20"))
PROMPT = [ChatMessage("user", "go")]
codec = AvroCodec()

Logged = tuple[int, int, TokenEvent]  # offset, timestamp (ms), event


async def seeds_saying_the_phrase(count: int) -> list[int]:
    """Seeds whose output says the phrase after its first 30 tokens and within its first 150."""
    engine = SimulatedEngine(SIM.model_copy(update={"ttft_ms": 0, "tokens_per_s": 100_000}))
    await engine.start()
    found: list[int] = []
    try:
        for seed in range(5_000):
            pieces = [out.text_diff async for out in engine.generate(
                GenerationInput(f"s{seed}", tuple(PROMPT), SamplingParams(seed=seed)))]
            at = "".join(pieces).find(PHRASE)
            if len("".join(pieces[:30])) < at < len("".join(pieces[:150])):
                found.append(seed)
                if len(found) == count:
                    break
    finally:
        await engine.close()
    return found


def cut_after_phrase(stream: list[Logged], phrase: str = PHRASE) -> tuple[int, int] | None:
    """For one stream's records in log order: milliseconds from the event that completes ``phrase``
    to the truncation, and the token events written between them; None if it was never cut."""
    text, said_at, between = "", None, 0
    for _, timestamp, event in stream:
        if event.truncate:
            return (timestamp - said_at, between) if said_at is not None else None
        if said_at is None:
            text += event.text or ""
            if phrase in text:
                said_at = timestamp
        else:
            between += 1
    return None


async def stream_all(stack: Any, seeds: list[int]) -> list[str]:
    key = await stack.create_key("bench-truncation", TIER)
    ids = []
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
        for seed in seeds:
            response = await http.post(f"{stack.edge_url}/v1/chat/completions", json={
                "model": MODEL, "seed": seed, "messages": [{"role": m.role, "content": m.content} for m in PROMPT]})
            response.raise_for_status()
            ids.append(response.json()["id"])
    return ids


async def logged_streams(stack: Any) -> dict[str, list[Logged]]:
    """Every token event of the stack's rolled reply logs, by request, in log order."""
    bus = stack.bus_settings()
    catalog = TopicCatalog(bus)
    consumer = make_consumer(bus)
    await consumer.start()
    try:
        logs = [TopicPartition(name, 0) for name in await consumer.topics() if catalog.parse_rolled_reply_log(name)]
        consumer.assign(logs)
        for tp in logs:
            consumer.seek(tp, 0)
        streams: dict[str, list[Logged]] = {}
        quiet_until = time.monotonic() + 3
        while time.monotonic() < quiet_until:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                quiet_until = time.monotonic() + 1
                for record in records:
                    event = codec.decode(record.value, TokenEvent)
                    streams.setdefault(event.request_id, []).append((record.offset, record.timestamp, event))
    finally:
        await consumer.stop()
    return {request_id: sorted(stream, key=lambda r: r[0]) for request_id, stream in streams.items()}


def run() -> dict[str, Any]:
    seeds = asyncio.run(seeds_saying_the_phrase(STREAMS))
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy.toml"
        policy.write_text(POLICY)
        with bench_stack(SIM, extra_env={"TOKENBUS_MODERATION_POLICY_FILE": str(policy)}) as stack:
            ids = asyncio.run(stream_all(stack, seeds))
            time.sleep(1)  # the last truncation's record is in the log by then
            streams = asyncio.run(logged_streams(stack))
            broker = stack.bus_settings().broker
    cuts = [cut_after_phrase(streams.get(request_id, [])) for request_id in ids]
    made = [cut for cut in cuts if cut is not None]
    delays = sorted(ms for ms, _ in made)
    past = [between for _, between in made]
    return {"scenario": "truncation", "engine": SIM.model_dump(), "broker": broker,
            "streams": len(ids), "cut": len(made),
            "delay_ms": {"median": statistics.median(delays) if delays else None,
                         "mean": round(statistics.mean(delays), 2) if delays else None,
                         "max": max(delays, default=None)},
            "events_past_phrase": {"none": past.count(0), "total": sum(past), "max": max(past, default=None)}}


def table(result: dict[str, Any]) -> str:
    delay, past = result["delay_ms"], result["events_past_phrase"]
    return "\n".join([
        "| streams | cut | truncation after the phrase, ms: median / mean / max"
        " | token events past the phrase: streams with none / total / max |",
        "|---:|---:|---|---|",
        f"| {result['streams']} | {result['cut']} | {delay['median']} / {delay['mean']} / {delay['max']}"
        f" | {past['none']} / {past['total']} / {past['max']} |",
    ]) + f"\n\nstreams one at a time, 10 ms a token, `{result['broker']}` client profile"
