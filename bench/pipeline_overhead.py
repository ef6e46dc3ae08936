"""Scenario: what the bus adds. The same simulated engine, called in-process and
through the whole pipeline (HTTP -> edge -> Kafka -> GPU consumer -> Kafka -> edge -> SSE),
at several concurrencies; TTFT and ITL percentiles and the milliseconds added."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from bench.baselines import engine_sender
from bench.stack import MODEL, bench_stack
from gpu_consumers.engines import SimulatedEngine, SimulatedEngineSettings
from infra.loadgen import Summary, run_load, stream_chat, summarize

OUTPUT_TOKENS = 32
SIM = SimulatedEngineSettings(seed=1, ttft_ms=20, tokens_per_s=100, min_tokens=OUTPUT_TOKENS, max_tokens=OUTPUT_TOKENS)
PERCENTILES = (50.0, 99.0)


def prompts(count: int) -> list[str]:
    return [f"Summarise the design of an event bus, variant {i}." for i in range(count)]


async def measure_direct(concurrency: int, requests: int) -> Summary:
    engine = SimulatedEngine(SIM)
    await engine.start()
    try:
        results, duration = await run_load(engine_sender(engine, OUTPUT_TOKENS), prompts(requests), max_concurrency=concurrency)
    finally:
        await engine.close()
    return summarize(results, duration, PERCENTILES)


async def measure_pipeline(edge_url: str, concurrency: int, requests: int) -> Summary:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        url = f"{edge_url}/v1/chat/completions"

        async def send(prompt: str):
            payload = {"model": MODEL, "stream": True, "max_tokens": OUTPUT_TOKENS,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": prompt}]}
            return await stream_chat(http, url, payload)

        await run_load(send, prompts(min(4, requests)), max_concurrency=concurrency)  # warm-up, not counted
        results, duration = await run_load(send, prompts(requests), max_concurrency=concurrency)
    return summarize(results, duration, PERCENTILES)


def overhead_row(concurrency: int, direct: Summary, pipeline: Summary) -> dict[str, Any]:
    row: dict[str, Any] = {"concurrency": concurrency, "requests": pipeline.completed + pipeline.failed,
                           "failed": pipeline.failed}
    for metric in ("ttft_ms", "itl_ms", "e2el_ms"):
        for stat in ("median", "p99"):
            d, p = getattr(direct, metric)[stat], getattr(pipeline, metric)[stat]
            row[f"{metric}_{stat}_direct"] = round(d, 2)
            row[f"{metric}_{stat}_pipeline"] = round(p, 2)
            row[f"{metric}_{stat}_added"] = round(p - d, 2)
    row["output_throughput_ratio"] = round(pipeline.output_throughput / max(direct.output_throughput, 1e-9), 3)
    return row


def run(concurrencies: tuple[int, ...] = (1, 32), requests_per_level: int = 64) -> dict[str, Any]:
    rows = []
    with bench_stack(SIM) as stack:
        for concurrency in concurrencies:
            count = max(requests_per_level, 4 * concurrency) if concurrency > 1 else requests_per_level // 2
            direct = asyncio.run(measure_direct(concurrency, count))
            pipeline = asyncio.run(measure_pipeline(stack.edge_url, concurrency, count))
            rows.append(overhead_row(concurrency, direct, pipeline))
    return {"scenario": "pipeline_overhead", "engine": SIM.model_dump(), "output_tokens": OUTPUT_TOKENS, "rows": rows}


def table(result: dict[str, Any]) -> str:
    head = f"{'conc':>4} {'metric':>6} {'p50 direct':>11} {'p50 pipe':>9} {'+ms':>7} {'p99 direct':>11} {'p99 pipe':>9} {'+ms':>7}"
    lines = [head]
    for row in result["rows"]:
        for metric in ("ttft_ms", "itl_ms", "e2el_ms"):
            name = metric.removesuffix("_ms").upper()
            lines.append(
                f"{row['concurrency']:>4} {name:>6} "
                f"{row[f'{metric}_median_direct']:>11.2f} {row[f'{metric}_median_pipeline']:>9.2f} {row[f'{metric}_median_added']:>7.2f} "
                f"{row[f'{metric}_p99_direct']:>11.2f} {row[f'{metric}_p99_pipeline']:>9.2f} {row[f'{metric}_p99_added']:>7.2f}"
            )
    return "\n".join(lines)
