"""Scenario 8, the stream processors: what input moderation adds to time to first token, by
route (the same stack with three edges: moderating inline, the default; through the
ingress processor; not at all), alternated round by round, and how many records per
second each processor handles when a burst lands on its input topic."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx

from bench.stack import MODEL, bench_stack, serve_config
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.loadgen import summarize
from tokenbus.infra.loadgen.serve import run_serve
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, Completion, TokenEvent, now_ms
from tokenbus.topics import TopicCatalog, make_producer

OUTPUT_TOKENS = 16
SIM = SimulatedEngineSettings(seed=1, ttft_ms=20, tokens_per_s=200, min_tokens=OUTPUT_TOKENS, max_tokens=OUTPUT_TOKENS)
UNSERVED = "bench-unserved"  # ingress bursts are routed here, so no GPU consumer runs them
CONCURRENCIES = (1, 16)
ROUNDS = 3
REQUESTS_PER_ROUND = 40
BURSTS = {"moderate-ingress": 2000, "moderate-output": 20000, "completions": 5000}
COUNTERS = {"moderate-ingress": ["moderate-ingress", "store-decisions"], "moderate-output": ["moderate-output"],
            "completions": ["write-transcripts", "bill-usage"]}


async def serve_round(url: str, key: str, concurrency: int) -> list:
    config = serve_config(url, key, num_prompts=REQUESTS_PER_ROUND, max_concurrency=concurrency,
                          output_len=OUTPUT_TOKENS, warmup=2)
    _, results = await run_serve(config)
    return results


ROUTES = ("direct", "inline", "ingress")


def hop_rows(stack, urls: dict[str, str]) -> list[dict[str, Any]]:
    """``urls``: an edge per route (``TOKENBUS_EDGE_ROUTE``)."""
    rows = []
    for concurrency in CONCURRENCIES:
        results: dict[str, list] = {route: [] for route in urls}
        for _ in range(ROUNDS):  # alternate, so drift on this noisy machine hits all alike
            for route, url in urls.items():
                results[route] += asyncio.run(serve_round(url, stack.dev_key, concurrency))
        row: dict[str, Any] = {"concurrency": concurrency}
        for route, rs in results.items():
            summary = summarize(rs, 1.0, (50.0, 99.0))
            row[f"ttft_p50_{route}"] = round(summary.ttft_ms["median"], 2)
            row[f"ttft_p99_{route}"] = round(summary.ttft_ms["p99"], 2)
            row[f"failed_{route}"] = summary.failed
        for route in urls:
            for q in ("p50", "p99"):
                row[f"ttft_{q}_added_{route}"] = round(row[f"ttft_{q}_{route}"] - row[f"ttft_{q}_direct"], 2)
        rows.append(row)
    return rows


def burst_records(kind: str, catalog: TopicCatalog, count: int) -> list[tuple[str, Any, str]]:
    tag = uuid.uuid4().hex[:8]
    if kind == "moderate-ingress":
        return [(catalog.ingress, ChatRequest(f"b{tag}-{i}", UNSERVED, "standard",
                                              [ChatMessage("user", f"question {i}, mail me at x{i}@example.com")],
                                              catalog.tokens, 7, tenant="bench"), f"b{tag}-{i}") for i in range(count)]
    if kind == "moderate-output":
        return [(catalog.tokens, TokenEvent(f"t{tag}-{i // 20}", i % 20, text=" every token"), f"t{tag}-{i // 20}")
                for i in range(count)]
    at = now_ms()
    return [(catalog.completions, Completion(f"c{tag}-{i}", MODEL, "standard", "an answer", "stop", 12, 30, at, at,
                                             at + 40, tenant="bench", messages=[ChatMessage("user", "q")]),
             f"c{tag}-{i}") for i in range(count)]


async def processed(url: str, processor: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{url}/metrics")).text
    for line in text.splitlines():
        if line.startswith(f'tokenbus:processor_events_total{{processor="{processor}"}}'):
            return float(line.split()[-1])
    return 0.0


async def burst(stack, kind: str, count: int) -> dict[str, Any]:
    catalog = TopicCatalog(stack.bus_settings())
    codec = AvroCodec()
    records = burst_records(kind, catalog, count)
    processors = COUNTERS[kind]
    before = {p: await processed(stack.processors_url, p) for p in processors}
    producer = make_producer(stack.bus_settings(), linger_ms=5)
    await producer.start()
    started = time.perf_counter()
    try:
        deliveries = [await producer.send(topic, codec.encode(record), key=key.encode()) for topic, record, key in records]
        await asyncio.gather(*deliveries)
    finally:
        await producer.stop()
    produced_s = time.perf_counter() - started
    done: dict[str, float] = {}
    while len(done) < len(processors) and time.perf_counter() - started < 300:
        for p in processors:
            if p not in done and await processed(stack.processors_url, p) - before[p] >= count:
                done[p] = time.perf_counter() - started
        await asyncio.sleep(0.05)
    return {"input": kind, "records": count, "produce_s": round(produced_s, 3),
            "processors": {p: {"seconds": round(s, 3), "records_per_s": round(count / s)} for p, s in done.items()}}


def run() -> dict[str, Any]:
    with bench_stack(SIM, unserved=(UNSERVED,), extra_env={"TOKENBUS_PROC_BILLING_BATCH_S": "0.2"}) as stack:
        urls = {"inline": stack.edge_url}  # the stack's own edge: the default route
        for partition, route in enumerate(("direct", "ingress"), start=1):
            port = free_port()
            stack.start_edge(f"edge-{route}", port, reply_partitions=str(partition), env={"TOKENBUS_EDGE_ROUTE": route})
            urls[route] = f"http://{stack.settings.host}:{port}"
        rows = hop_rows(stack, {route: urls[route] for route in ROUTES})
        bursts = [asyncio.run(burst(stack, kind, count)) for kind, count in BURSTS.items()]
    return {"scenario": "processors", "engine": SIM.model_dump(), "output_tokens": OUTPUT_TOKENS,
            "requests_per_route": ROUNDS * REQUESTS_PER_ROUND, "hop": rows, "bursts": bursts}


def table(result: dict[str, Any]) -> str:
    lines = ["| conc | TTFT | no moderation | inline (default) | + ms | via `requests.ingress` | + ms |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["hop"]:
        for q in ("p50", "p99"):
            lines.append(f"| {r['concurrency']} | {q} | {r[f'ttft_{q}_direct']:.2f} | {r[f'ttft_{q}_inline']:.2f} | "
                         f"{r[f'ttft_{q}_added_inline']:.2f} | {r[f'ttft_{q}_ingress']:.2f} | "
                         f"{r[f'ttft_{q}_added_ingress']:.2f} |")
    lines += ["", "| input burst | records | processor | seconds | records/s |", "|---|---:|---|---:|---:|"]
    for b in result["bursts"]:
        for name, p in b["processors"].items():
            lines.append(f"| {b['input']} | {b['records']} | {name} | {p['seconds']:.2f} | {p['records_per_s']} |")
    return "\n".join(lines)
