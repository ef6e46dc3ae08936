"""``tokenbus bench serve``: benchmark any OpenAI-compatible streaming endpoint.

It takes the flags of vLLM's ``benchmark_serving.py`` (``--base-url``, ``--endpoint``,
``--backend``, ``--dataset-name``, ``--save-result``, ``--percentile-metrics``, ...) and writes
its result file with vLLM's flat keys (``median_ttft_ms``, ``p99_itl_ms``,
``request_throughput``, ...), so a vLLM command line and the tools that read vLLM result files
work unchanged. What tokenbus adds (failures by reason, several base URLs) only adds keys.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenbus.infra.loadgen.metrics import DEFAULT_METRICS, METRIC_HEADERS, Slo, Summary, format_summary, summarize, vllm_metrics
from tokenbus.infra.loadgen.prompts import CHAT_BACKEND, COMPLETIONS_BACKENDS, BenchPrompt, sharegpt_prompts, synthetic_prompts
from tokenbus.infra.loadgen.results import RequestResult
from tokenbus.infra.loadgen.runner import Progress, run_load
from tokenbus.infra.loadgen.sse_client import client_session, stream_chat

DEFAULT_PORT = 8700  # the embedded stack's edge (vLLM's own default is 8000)


@dataclass
class ServeConfig:
    """``base_url`` is a server root (``http://host:port``), or several, comma-separated, that
    share the load round-robin (e.g. two edges); ``endpoint`` is appended to each."""

    base_url: str
    model: str
    endpoint: str | None = None
    backend: str = CHAT_BACKEND
    served_model_name: str | None = None
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
    prefix_len: int = 0
    sharegpt_output_len: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # vLLM's --logprobs: each token's log probability and this many likeliest
    # vLLM's sampling flags (--temperature, --top-p, --top-k, --min-p, the penalties): sent with each
    # request as given, by their API names; those not given are not sent.
    sampling: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (99.0,)
    percentile_metrics: tuple[str, ...] = DEFAULT_METRICS
    goodput: list[str] = field(default_factory=list)
    api_key: str | None = None
    seed: int = 0
    progress: bool | None = None

    def api_urls(self) -> list[str]:
        """Each base URL with the endpoint. A base that ends in ``/v1`` (what OpenAI clients take)
        loses it when the endpoint starts with ``/v1/``, so either form works."""
        endpoint = self.endpoint or ("/v1/chat/completions" if self.backend == CHAT_BACKEND else "/v1/completions")
        urls = []
        for base in self.base_url.split(","):
            base = base.strip().rstrip("/")
            if base.endswith("/v1") and endpoint.startswith("/v1/"):
                base = base[: -len("/v1")]
            urls.append(base + endpoint)
        return urls


def load_prompts(config: ServeConfig, count: int) -> list[BenchPrompt]:
    if config.dataset == "sharegpt":
        if config.dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        return sharegpt_prompts(config.dataset_path, count, config.seed, config.sharegpt_output_len)
    return synthetic_prompts(count, config.input_len, config.output_len, config.range_ratio, config.seed,
                             config.prefix_len)


async def run_serve(config: ServeConfig) -> tuple[Summary, list[RequestResult]]:
    slo = Slo.parse(config.goodput)
    prompts = load_prompts(config, config.num_prompts + config.warmup)
    warmup, measured = prompts[: config.warmup], prompts[config.warmup :]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    connections = (config.max_concurrency or len(measured)) + 8
    urls = itertools.cycle(config.api_urls())
    model = config.served_model_name or config.model
    async with client_session(connections) as http:

        async def send(prompt: BenchPrompt) -> RequestResult:
            payload = prompt.payload(model, backend=config.backend, ignore_eos=config.ignore_eos,
                                     logprobs=config.logprobs, sampling=config.sampling)
            return await stream_chat(http, next(urls), payload, headers)

        if warmup:
            await run_load(send, warmup, max_concurrency=config.max_concurrency)
        results, duration = await run_load(
            send, measured, config.request_rate, config.burstiness, config.max_concurrency, config.seed,
            Progress(len(measured), "bench", config.progress),
        )
    return summarize(results, duration, config.percentiles, slo), results


def result_document(config: ServeConfig, summary: Summary, results: list[RequestResult] | None = None,
                    metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """vLLM's result file: setup, metadata, traffic, then the flat metrics; with ``results``
    (``--save-detailed``) the per-request lists too. ``failed`` and ``failure_reasons`` are ours."""
    document: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": config.backend,
        "model_id": config.model,
        "tokenizer_id": config.model,
        "num_prompts": config.num_prompts,
        **(metadata or {}),
        "request_rate": "inf" if config.request_rate == float("inf") else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        **vllm_metrics(summary, config.percentile_metrics),
        "failed": summary.failed,
        "failure_reasons": summary.errors,
    }
    if results is not None:
        document.update(
            input_lens=[r.prompt_tokens for r in results],
            output_lens=[r.output_tokens for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            generated_texts=[r.text for r in results],
            errors=[r.error for r in results],
        )
    return document


def result_path(config: ServeConfig, args: argparse.Namespace) -> Path | None:
    """Where ``--save-result`` writes: vLLM's file name unless ``--result-filename`` is given."""
    if not args.save_result:
        return None
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
    name = args.result_filename or (f"{config.backend}-{config.request_rate}qps{concurrency}-"
                                    f"{config.model.split('/')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return Path(args.result_dir or ".") / name


# vLLM's sampling parameter flags, each sent as the request field its name gives (``--top-k`` as ``top_k``).
SAMPLING_FLAGS: dict[str, type] = {"--temperature": float, "--top-p": float, "--top-k": int, "--min-p": float,
                                   "--presence-penalty": float, "--frequency-penalty": float,
                                   "--repetition-penalty": float}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags. Those that need vLLM's tokenizer or profiler are accepted and have no effect:
    token counts come from the usage the server reports."""
    parser.add_argument("--backend", default=CHAT_BACKEND, choices=[CHAT_BACKEND, *COMPLETIONS_BACKENDS],
                        help="openai-chat: /v1/chat/completions; openai, vllm: /v1/completions")
    parser.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8700; comma-separate several")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--endpoint", help="API path (default from --backend)")
    parser.add_argument("--model", default="tokenbus-sim")
    parser.add_argument("--served-model-name", help="the model name sent in requests (default --model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default $OPENAI_API_KEY")
    parser.add_argument("--dataset-name", "--dataset", dest="dataset", choices=["random", "sharegpt"],
                        default="random")
    parser.add_argument("--dataset-path", type=Path)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson; gamma shape otherwise")
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument("--num-warmups", "--warmup", dest="warmup", type=int, default=2,
                        help="requests sent first and not counted")
    parser.add_argument("--random-input-len", dest="input_len", type=int, default=64)
    parser.add_argument("--random-output-len", dest="output_len", type=int, default=64)
    parser.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=0.0)
    parser.add_argument("--random-prefix-len", dest="prefix_len", type=int, default=0)
    parser.add_argument("--sharegpt-output-len", type=int)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--percentile-metrics", default=",".join(DEFAULT_METRICS), help="of ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="SLO", help="ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--save-result", action="store_true", help="write the JSON result file")
    parser.add_argument("--save-detailed", action="store_true", help="with per-request lists")
    parser.add_argument("--result-dir")
    parser.add_argument("--result-filename")
    parser.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--logprobs", type=int, help="each token's log probability and this many likeliest tokens'")
    for flag, kind in SAMPLING_FLAGS.items():
        parser.add_argument(flag, type=kind, help="sent with each request (vLLM's sampling parameters)")
    for accepted in ("--tokenizer", "--tokenizer-mode", "--label"):
        parser.add_argument(accepted, help=argparse.SUPPRESS)
    for accepted in ("--trust-remote-code", "--profile", "--use-beam-search"):
        parser.add_argument(accepted, action="store_true", help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = [m for m in metrics if m not in METRIC_HEADERS]
    if unknown:
        raise ValueError(f"--percentile-metrics takes ttft, tpot, itl and e2el, not {', '.join(unknown)}")
    return ServeConfig(
        base_url=args.base_url or f"http://{args.host}:{args.port}", endpoint=args.endpoint, backend=args.backend,
        model=args.model, served_model_name=args.served_model_name, num_prompts=args.num_prompts,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        warmup=args.warmup, dataset=args.dataset, dataset_path=args.dataset_path, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
        sharegpt_output_len=args.sharegpt_output_len, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        sampling={name: value for flag in SAMPLING_FLAGS if (value := getattr(args, name := flag[2:].replace("-", "_")))
                  is not None},
        percentiles=tuple(float(p) for p in args.metric_percentiles.split(",") if p), percentile_metrics=metrics,
        goodput=args.goodput, api_key=args.api_key, seed=args.seed, progress=False if args.disable_tqdm else None,
    )


def parse_metadata(items: list[str]) -> dict[str, str]:
    metadata = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE, not {item!r}")
        metadata[key.strip()] = value.strip()
    return metadata


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        metadata = parse_metadata(args.metadata)
        Slo.parse(config.goodput)  # reject a bad --goodput before sending anything
    except ValueError as exc:
        print(f"tokenbus bench serve: {exc}")
        return 2
    summary, results = asyncio.run(run_serve(config))
    print(format_summary(" Serving Benchmark Result ", summary, config.percentile_metrics))
    path = result_path(config, args)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        document = result_document(config, summary, results if args.save_detailed else None, metadata)
        path.write_text(json.dumps(document, indent=2))
        print(f"results written to {path}")
    return 0 if summary.completed else 1
