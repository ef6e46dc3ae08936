"""Scenario: the ``hf`` engine's prefix cache, engine alone in this process (`python -m bench prefix_cache`).

Each request is a new conversation: one long system prompt and one short question, 8 output
tokens, a few at once. Two workloads: **shared**, where a round's requests share a few system
prompts (what the cache is for), and **unique**, where every request has a system prompt of its
own (nothing to reuse: what keeping the cache costs). Four engines: slot batching and
transformers' manager, each with its prefix cache (``TOKENBUS_HF_PREFIX_CACHING``, the default)
and without. Rounds alternate between the engines, each round with system prompts of its own, so
no round inherits another's cache. Per engine and workload: TTFT p50 / p99, the share of prompt
tokens served from the cache, output tokens/s and requests/s.

Runs on the device ``TOKENBUS_HF_DEVICE`` picks (the CPU here) with SmolLM2-135M unless
``TOKENBUS_HF_MODEL_PATH`` names another model; the slots get ``max_model_len`` 1,024 unless
``TOKENBUS_HF_MAX_MODEL_LEN`` says. Cache sizes differ: the slots keep at most one prompt a slot
(``SLOTS``), the manager what its blocks hold (on the CPU 64 blocks of 32 tokens, about five of
these prompts). `python -m bench gpu` runs the same comparison for slot batching on its 1B model at
64 concurrent.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any

from bench.prefix_routing import system_prompt
from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams
from tokenbus.infra.loadgen.metrics import percentile
from tokenbus.schemas import ChatMessage

SLOTS = 4  # the engine's sequences at once (the worker's max_num_seqs)
CONCURRENCY = 2
PROMPTS = 4  # system prompts a shared round draws from
WORDS = 300  # about 350 tokens a system prompt
REQUESTS = {"shared": 16, "unique": 8}  # a round's
ROUNDS = 2
OUTPUT_TOKENS = 8
ENGINES = [("slots", True), ("slots", False), ("manager", True), ("manager", False)]
WORKLOADS = ("shared", "unique")
_ids = itertools.count()


def round_inputs(round_no: int, workload: str, requests: int) -> list[GenerationInput]:
    rng = random.Random(round_no)
    prompts = [system_prompt(round_no, i, WORDS) for i in range(PROMPTS)]
    inputs = []
    for n in range(requests):
        system = prompts[rng.randrange(PROMPTS)] if workload == "shared" else system_prompt(round_no, 100 + n, WORDS)
        inputs.append(GenerationInput(f"prefix-cache-{next(_ids)}", (ChatMessage("system", system),
                                                                  ChatMessage("user", f"question {round_no}-{n}")),
                                      SamplingParams(max_tokens=OUTPUT_TOKENS)))
    return inputs


async def run_round(engine: Any, inputs: list[GenerationInput], concurrency: int) -> dict[str, Any]:
    """The inputs ``concurrency`` at a time: each one's TTFT, prompt and cached tokens, and the
    round's wall time and output tokens."""
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = output_tokens = 0
    work = list(inputs)

    async def client() -> None:
        nonlocal prompt_tokens, cached_tokens, output_tokens
        while work:
            inp = work.pop()
            started = time.perf_counter()
            first = None
            async for out in engine.generate(inp):
                if first is None and out.token_ids_diff:
                    first = time.perf_counter() - started
                if out.finished:
                    assert out.finish_reason in ("stop", "length"), out.error
                    prompt_tokens += out.prompt_tokens
                    cached_tokens += out.cached_tokens
                    output_tokens += out.completion_tokens
            ttfts.append(1e3 * (first if first is not None else time.perf_counter() - started))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"ttft_ms": ttfts, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "output_tokens": output_tokens, "requests": len(inputs), "wall_s": time.perf_counter() - started}


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [t for r in rounds for t in r["ttft_ms"]]
    wall = sum(r["wall_s"] for r in rounds)
    return {"requests": sum(r["requests"] for r in rounds),
            "ttft_p50_ms": round(percentile(ttfts, 50), 1), "ttft_p99_ms": round(percentile(ttfts, 99), 1),
            "prompt_tokens_mean": round(sum(r["prompt_tokens"] for r in rounds) / len(ttfts), 1),
            "cached_share": round(sum(r["cached_tokens"] for r in rounds) / max(sum(r["prompt_tokens"] for r in rounds), 1), 3),
            "output_tokens_per_s": round(sum(r["output_tokens"] for r in rounds) / wall, 1),
            "requests_per_s": round(sum(r["requests"] for r in rounds) / wall, 2)}


async def compare(engines: dict[tuple[str, bool], Any], concurrency: int, requests: dict[str, int],
                  rounds: int = ROUNDS) -> list[dict[str, Any]]:
    """Engines started, keyed by (batching, prefix caching), round by round on each workload: a row
    for each engine and workload."""
    for engine in engines.values():  # warm-up, on prompts of its own
        await run_round(engine, round_inputs(-1, "unique", concurrency), concurrency)
    results: dict[tuple[str, bool, str], list[dict[str, Any]]] = {}
    for round_no in range(rounds):
        for workload in WORKLOADS:
            inputs = round_inputs(round_no if workload == "shared" else 1000 + round_no, workload, requests[workload])
            for key, engine in engines.items():
                results.setdefault((*key, workload), []).append(await run_round(engine, inputs, concurrency))
    return [{"batching": batching, "prefix_caching": caching, "workload": workload, **summary(rounds_)}
            for (batching, caching, workload), rounds_ in results.items()]


async def measure() -> dict[str, Any]:
    from tokenbus.gpu_consumers.engines.hf import HfEngine
    from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings

    engines = {}
    try:
        for batching, caching in ENGINES:
            settings = HfEngineSettings(batching=batching, prefix_caching=caching,
                                        max_model_len=HfEngineSettings().max_model_len or 1024)
            engine = engines[(batching, caching)] = HfEngine(settings, max_num_seqs=SLOTS)
            await engine.start()
        return {"device": engine.device, "rows": await compare(engines, CONCURRENCY, REQUESTS)}
    finally:
        for engine in engines.values():
            await engine.close()


def run() -> dict[str, Any]:
    return {"scenario": "prefix_cache", "slots": SLOTS, "concurrency": CONCURRENCY, "rounds": ROUNDS,
            "requests_per_round": REQUESTS, "prompts_per_round": PROMPTS, "output_tokens": OUTPUT_TOKENS,
            **asyncio.run(measure())}


def table(result: dict[str, Any]) -> str:
    return "\n".join([f"`hf` engine alone on {result['device']}, {result['slots']} sequences at once, concurrency "
                      f"{result['concurrency']}, {result['rounds']} rounds of "
                      f"{result['requests_per_round']['shared']} requests sharing {result['prompts_per_round']} "
                      f"system prompts and {result['requests_per_round']['unique']} with one each, "
                      f"{result['output_tokens']} output tokens", "", *rows_table(result["rows"])])


def rows_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| batching | prefix cache | workload | prompt tokens | TTFT p50 | TTFT p99 | from cache | tokens/s | requests/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in sorted(rows, key=lambda r: (r["workload"], r["batching"], not r["prefix_caching"])):
        lines.append(f"| {row['batching']} | {'on' if row['prefix_caching'] else 'off'} | {row['workload']} | "
                     f"{row['prompt_tokens_mean']} | {row['ttft_p50_ms']} ms | {row['ttft_p99_ms']} ms | "
                     f"{100 * row['cached_share']:.1f} % | {row['output_tokens_per_s']} | {row['requests_per_s']} |")
    return lines
