"""``tokenbus bench serve``: benchmark any OpenAI-compatible streaming endpoint."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenbus.infra.loadgen.metrics import Slo, Summary, format_summary, summarize
from tokenbus.infra.loadgen.prompts import BenchPrompt, sharegpt_prompts, synthetic_prompts
from tokenbus.infra.loadgen.results import RequestResult
from tokenbus.infra.loadgen.runner import Progress, run_load
from tokenbus.infra.loadgen.sse_client import stream_chat


@dataclass
class ServeConfig:
    base_url: str
    model: str
    num_prompts: int = 100
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 2
    dataset: str = "random"
    dataset_path: Path | None = None
    input_len: int = 64
    output_len: int = 64
    range_ratio: float = 0.0
    percentiles: tuple[float, ...] = (99.0,)
    goodput: list[str] = field(default_factory=list)
    api_key: str | None = None
    seed: int = 0
    progress: bool | None = None


def load_prompts(config: ServeConfig, count: int) -> list[BenchPrompt]:
    if config.dataset == "sharegpt":
        if config.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path")
        return sharegpt_prompts(config.dataset_path, count, config.seed)
    return synthetic_prompts(count, config.input_len, config.output_len, config.range_ratio, config.seed)


async def run_serve(config: ServeConfig) -> tuple[Summary, list[RequestResult]]:
    slo = Slo.parse(config.goodput)
    prompts = load_prompts(config, config.num_prompts + config.warmup)
    warmup, measured = prompts[: config.warmup], prompts[config.warmup :]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    connections = (config.max_concurrency or len(measured)) + 8
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    # Several base URLs (comma-separated) share the load round-robin, e.g. two edges.
    urls = itertools.cycle([u.strip().rstrip("/") + "/chat/completions" for u in config.base_url.split(",")])
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits) as http:

        async def send(prompt: BenchPrompt) -> RequestResult:
            return await stream_chat(http, next(urls), prompt.payload(config.model), headers)

        if warmup:
            await run_load(send, warmup, max_concurrency=config.max_concurrency)
        results, duration = await run_load(
            send, measured, config.request_rate, config.burstiness, config.max_concurrency, config.seed,
            Progress(len(measured), "bench", config.progress),
        )
    return summarize(results, duration, config.percentiles, slo), results


def result_document(config: ServeConfig, summary: Summary) -> dict[str, Any]:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in config.__dict__.items()}
    settings["request_rate"] = "inf" if settings["request_rate"] == float("inf") else settings["request_rate"]
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": settings, **summary.to_dict()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8700/v1", help="comma-separate several to spread load")
    parser.add_argument("--model", default="tokenbus-sim")
    parser.add_argument("--api-key")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson; gamma shape otherwise")
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted")
    parser.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
    parser.add_argument("--dataset-path", type=Path)
    parser.add_argument("--random-input-len", dest="input_len", type=int, default=64)
    parser.add_argument("--random-output-len", dest="output_len", type=int, default=64)
    parser.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=0.0)
    parser.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--goodput", nargs="*", default=[], metavar="SLO", help="ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--result-file", type=Path, help="write the JSON result here")
    parser.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        base_url=args.base_url, model=args.model, num_prompts=args.num_prompts, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, warmup=args.warmup, dataset=args.dataset,
        dataset_path=args.dataset_path, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, percentiles=tuple(float(p) for p in args.percentiles.split(",") if p),
        goodput=args.goodput, api_key=args.api_key, seed=args.seed,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    Slo.parse(config.goodput)  # reject a bad --goodput before sending anything
    summary, _ = asyncio.run(run_serve(config))
    print(format_summary("Serving Benchmark Result", summary))
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(result_document(config, summary), indent=2))
        print(f"results written to {args.result_file}")
    return 0 if summary.completed else 1
