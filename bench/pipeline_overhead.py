"""Scenario 1, what the bus adds: the same simulated engine called in-process and
through the whole pipeline (HTTP -> edge -> Kafka -> GPU consumer -> Kafka -> edge -> SSE)
at several concurrencies; TTFT, ITL and E2EL percentiles and the milliseconds added. The same
load as text completions (``/v1/completions``) beside the chat completions, in the same run."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.baselines import engine_sender
from bench.stack import bench_stack, serve_config
from tokenbus.gpu_consumers.engines import SimulatedEngine, SimulatedEngineSettings
from tokenbus.infra.loadgen import Summary, run_load, summarize
from tokenbus.infra.loadgen.prompts import CHAT_BACKEND, synthetic_prompts
from tokenbus.infra.loadgen.serve import run_serve

OUTPUT_TOKENS = 32
SIM = SimulatedEngineSettings(seed=1, ttft_ms=20, tokens_per_s=100, min_tokens=OUTPUT_TOKENS, max_tokens=OUTPUT_TOKENS)
CONCURRENCIES = (1, 32, 128)


def request_count(concurrency: int) -> int:
    # 128 at concurrency 1 (not 32): a p99 of 32 requests is their slowest but one.
    return 128 if concurrency == 1 else 4 * concurrency


async def measure_direct(concurrency: int, requests: int) -> Summary:
    engine = SimulatedEngine(SIM)
    await engine.start()
    try:
        prompts = synthetic_prompts(requests, 16, OUTPUT_TOKENS)
        results, duration = await run_load(engine_sender(engine), prompts, max_concurrency=concurrency)
    finally:
        await engine.close()
    return summarize(results, duration, (50.0, 99.0))


async def measure_pipeline(edge_url: str, api_key: str, concurrency: int, requests: int,
                           backend: str = CHAT_BACKEND) -> Summary:
    config = serve_config(edge_url, api_key, num_prompts=requests, max_concurrency=concurrency,
                          output_len=OUTPUT_TOKENS, warmup=4, backend=backend)
    summary, _ = await run_serve(config)
    return summary


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


def text_row(concurrency: int, chat: Summary, text: Summary) -> dict[str, Any]:
    """The same load as text completions (``/v1/completions``, vLLM's ``--backend vllm``) against
    chat completions, in the same run."""
    row: dict[str, Any] = {"concurrency": concurrency, "failed": text.failed}
    for name, summary in (("chat", chat), ("text", text)):
        row[f"{name}_ttft_ms_median"] = round(summary.ttft_ms["median"], 2)
        row[f"{name}_itl_ms_median"] = round(summary.itl_ms["median"], 2)
        row[f"{name}_output_throughput"] = round(summary.output_throughput, 1)
    row["output_throughput_ratio"] = round(text.output_throughput / max(chat.output_throughput, 1e-9), 3)
    return row


def run() -> dict[str, Any]:
    rows, text_rows = [], []
    with bench_stack(SIM) as stack:
        for concurrency in CONCURRENCIES:
            count = request_count(concurrency)
            direct = asyncio.run(measure_direct(concurrency, count))
            pipeline = asyncio.run(measure_pipeline(stack.edge_url, stack.dev_key, concurrency, count))
            text = asyncio.run(measure_pipeline(stack.edge_url, stack.dev_key, concurrency, count, "vllm"))
            rows.append(overhead_row(concurrency, direct, pipeline))
            text_rows.append(text_row(concurrency, pipeline, text))
    return {"scenario": "pipeline_overhead", "engine": SIM.model_dump(), "output_tokens": OUTPUT_TOKENS, "rows": rows,
            "text_completions": text_rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| conc | metric | p50 direct | p50 pipe | + ms | p99 direct | p99 pipe | + ms |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        for metric in ("ttft_ms", "itl_ms", "e2el_ms"):
            cells = [row[f"{metric}_{stat}_{kind}"] for stat in ("median", "p99") for kind in ("direct", "pipeline", "added")]
            name = metric.removesuffix("_ms").upper()
            lines.append(f"| {row['concurrency']} | {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    lines.append("")
    lines.append("| conc | requests | failed | output tok/s, pipe / direct |")
    lines.append("|---:|---:|---:|---:|")
    for row in result["rows"]:
        lines.append(f"| {row['concurrency']} | {row['requests']} | {row['failed']} | {row['output_throughput_ratio']:.3f} |")
    lines += ["", "Text completions (`/v1/completions`) against chat completions, through the pipeline:", "",
              "| conc | TTFT p50 chat / text | ITL p50 chat / text | output tok/s chat / text | text / chat | failed |",
              "|---:|---:|---:|---:|---:|---:|"]
    for row in result.get("text_completions", []):
        lines.append(f"| {row['concurrency']} | {row['chat_ttft_ms_median']:.2f} / {row['text_ttft_ms_median']:.2f} | "
                     f"{row['chat_itl_ms_median']:.2f} / {row['text_itl_ms_median']:.2f} | "
                     f"{row['chat_output_throughput']:.1f} / {row['text_output_throughput']:.1f} | "
                     f"{row['output_throughput_ratio']:.3f} | {row['failed']} |")
    return "\n".join(lines)
