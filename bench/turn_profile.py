"""Scenario: where one chat turn's time goes, hop by hop, at concurrency 1.

Sequential streaming requests through the embedded stack (moderation on); each record's Kafka
timestamp (CreateTime, set by the process that produced it) is set against the client's clock
(one machine, one clock):

- client → routed record: HTTP, authentication, rate limits, the stream record in Redis, input
  moderation (in the edge, its default route) and the produce to ``requests.<model>.<tier>``;
- routed → first token record: the GPU consumer's fetch and admission, the engine's time to the
  first token (the simulated engine's own TTFT, as when it is called in process), the publish;
- first token record → client: the edge's reply fetch, relay and SSE write, the client's parse.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx

from bench.stack import MODEL, bench_stack
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.schemas import AvroCodec, ChatRequest, TokenEvent
from tokenbus.topics import BusSettings, TopicCatalog, make_consumer, topic_partitions

SIM = SimulatedEngineSettings(seed=1, ttft_ms=20, tokens_per_s=100, min_tokens=8, max_tokens=8)
REQUESTS = int(os.environ.get("TOKENBUS_BENCH_TURN_REQUESTS", "40"))
WARMUP = 5
# 0.3 s: the stack stays busy; above the readers' idle threshold (2 s), each turn wakes an idle stack.
GAP_S = float(os.environ.get("TOKENBUS_BENCH_TURN_GAP_S", "0.3"))
HOPS = ("client_to_routed_ms", "worker_and_engine_ms", "token_to_client_ms", "ttft_ms")


async def timed_requests(edge_url: str, api_key: str) -> dict[str, tuple[float, float]]:
    """request id -> (sent, first content chunk received), epoch milliseconds."""
    times = {}
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {api_key}"}) as http:
        for i in range(REQUESTS):
            body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": f"turn {i}"}]}
            sent = time.time() * 1000
            async with http.stream("POST", f"{edge_url}/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        times[chunk["id"]] = (sent, time.time() * 1000)
                        break
            await asyncio.sleep(GAP_S)
    return times


async def record_times(bus: BusSettings, topics: list[str] | Callable[[str], bool], kind: type,
                       first_text_only: bool = False) -> dict[str, int]:
    """request id -> timestamp of its first record (with text, for token events) on ``topics``
    (names, or a test of a name: every reply log, rolled ones included)."""
    codec = AvroCodec()
    consumer = make_consumer(bus)
    await consumer.start()
    found: dict[str, int] = {}
    try:
        names = topics if isinstance(topics, list) else [t for t in await consumer.topics() if topics(t)]
        consumer.assign(await topic_partitions(consumer, *names))
        await consumer.seek_to_beginning()
        while batches := await consumer.getmany(timeout_ms=1000):
            for record in (r for batch in batches.values() for r in batch):
                value = codec.decode(record.value, kind)
                if first_text_only and not value.text:
                    continue
                found.setdefault(value.request_id, record.timestamp)
    finally:
        await consumer.stop()
    return found


def run() -> dict[str, Any]:
    with bench_stack(SIM) as stack:
        times = asyncio.run(timed_requests(stack.edge_url, stack.dev_key))
        bus = stack.bus_settings()
        catalog = TopicCatalog(bus)
        routed = asyncio.run(record_times(bus, catalog.model_request_topics(MODEL), ChatRequest))
        first_token = asyncio.run(record_times(bus, catalog.is_reply_log, TokenEvent, first_text_only=True))
    rows = []
    for request_id, (sent, received) in list(times.items())[WARMUP:]:
        if request_id in routed and request_id in first_token:
            rows.append(dict(zip(HOPS, (routed[request_id] - sent, first_token[request_id] - routed[request_id],
                                        received - first_token[request_id], received - sent))))
    summary = {hop: {"p50": round(statistics.median(r[hop] for r in rows), 1),
                     "mean": round(statistics.fmean(r[hop] for r in rows), 1)} for hop in HOPS}
    engine_ms = SIM.ttft_ms  # the simulated engine's first token comes when prefill ends
    return {"scenario": "turn_profile", "engine": SIM.model_dump(), "measured_requests": len(rows),
            "engine_first_token_ms": engine_ms, "hops": summary}


def table(result: dict[str, Any]) -> str:
    names = {"client_to_routed_ms": "client → routed record (HTTP, auth, limits, Redis, moderation, produce)",
             "worker_and_engine_ms": "routed → first token record (GPU consumer + engine's "
                                     f"{result['engine_first_token_ms']:.0f} ms)",
             "token_to_client_ms": "first token record → client (reply fetch, relay, SSE)",
             "ttft_ms": "time to first token"}
    lines = ["| hop | p50 ms | mean ms |", "|---|---:|---:|"]
    lines += [f"| {names[h]} | {v['p50']:.1f} | {v['mean']:.1f} |" for h, v in result["hops"].items()]
    return "\n".join(lines) + f"\n\n{result['measured_requests']} sequential requests, {GAP_S} s apart"
