"""Scenario: the ``hf`` engine's prefix cache, engine alone in this process (`python -m bench prefix_cache`).

Each request is a new conversation: one long system prompt and one short question, 8 output
tokens, a few at once. Two workloads: **shared**, where a round's requests share a few system
prompts (what the cache is for), and **unique**, where every request has a system prompt of its
own (nothing to reuse: what keeping the cache costs). Four engines: slot batching and
transformers' manager, each with its prefix cache (``TOKENBUS_HF_PREFIX_CACHING``, the default)
and without. Rounds alternate between the engines, each round with system prompts of its own, so
no round inherits another's cache. Per engine and workload: TTFT p50 / p99, the share of prompt
tokens served from the cache, output tokens/s and requests/s.

Then a busy engine: **busy** keeps every slot running (as many at once as there are slots), its
requests drawing on twice as many system prompts as there are slots, so few slots are ever free
to keep a prefix in. Slot batching with its prefix cache, without and with rows that only keep
prefixes (``TOKENBUS_HF_PREFIX_ROWS``, as many as the slots).

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
REQUESTS = {"shared": 16, "unique": 8, "busy": 16}  # a round's
ROUNDS = 2
OUTPUT_TOKENS = 8
# (batching, prefix caching, keeping rows)
ENGINES = [("slots", True, 0), ("slots", False, 0), ("manager", True, 0), ("manager", False, 0)]
BUSY_ENGINES = [("slots", True, 0), ("slots", True, SLOTS)]
WORKLOADS = ("shared", "unique")
PROMPTS_OF = {"shared": PROMPTS, "busy": 2 * SLOTS}  # system prompts a round draws from; unique: one each
_ids = itertools.count()


def round_inputs(round_no: int, workload: str, requests: int) -> list[GenerationInput]:
    rng = random.Random(round_no)
    prompts = [system_prompt(round_no, i, WORDS) for i in range(PROMPTS_OF.get(workload, 0))]
    inputs = []
    for n in range(requests):
        system = rng.choice(prompts) if prompts else system_prompt(round_no, 100 + n, WORDS)
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


Engines = dict[tuple[str, bool, int], Any]  # started, keyed by (batching, prefix caching, keeping rows)


async def compare(engines: Engines, concurrency: int, requests: dict[str, int], rounds: int = ROUNDS,
                  workloads: tuple[str, ...] = WORKLOADS) -> list[dict[str, Any]]:
    """The engines round by round on each workload: a row for each engine and workload."""
    for engine in engines.values():  # warm-up, on prompts of its own
        await run_round(engine, round_inputs(-1, "unique", concurrency), concurrency)
    results: dict[tuple[str, bool, int, str], list[dict[str, Any]]] = {}
    for round_no in range(rounds):
        for workload in workloads:
            seed = {"shared": round_no, "unique": 1000 + round_no}.get(workload, 2000 + round_no)
            inputs = round_inputs(seed, workload, requests[workload])
            for key, engine in engines.items():
                results.setdefault((*key, workload), []).append(await run_round(engine, inputs, concurrency))
    return [{"batching": batching, "prefix_caching": caching, "keeping_rows": keeping, "workload": workload,
             **summary(rounds_)} for (batching, caching, keeping, workload), rounds_ in results.items()]


async def started_engines(keys: list[tuple[str, bool, int]], max_num_seqs: int, engines: Engines,
                          **settings: Any) -> Engines:
    """Each of ``keys`` started (into ``engines``, which the caller closes, also on failure)."""
    from tokenbus.gpu_consumers.engines.hf import HfEngine
    from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings

    for batching, caching, keeping in keys:
        if (batching, caching, keeping) not in engines:
            engine = HfEngine(HfEngineSettings(batching=batching, prefix_caching=caching, prefix_rows=keeping,
                                               **settings), max_num_seqs=max_num_seqs)
            engines[(batching, caching, keeping)] = engine
            await engine.start()
    return {key: engines[key] for key in keys}


async def measure() -> dict[str, Any]:
    from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings

    engines: Engines = {}
    length = HfEngineSettings().max_model_len or 1024
    try:
        rows = await compare(await started_engines(ENGINES, SLOTS, engines, max_model_len=length), CONCURRENCY, REQUESTS)
        busy = await started_engines(BUSY_ENGINES, SLOTS, engines, max_model_len=length)
        rows += await compare(busy, SLOTS, REQUESTS, workloads=("busy",))
        return {"device": next(iter(engines.values())).device, "rows": rows}
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
                      f"{result['output_tokens']} output tokens; busy: {result['slots']} at once, "
                      f"{result['requests_per_round']['busy']} requests a round on {2 * result['slots']} system prompts",
                      "", *rows_table(result["rows"])])


def rows_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| batching | prefix cache | keeping rows | workload | prompt tokens | TTFT p50 | TTFT p99 | from cache"
             " | tokens/s | requests/s |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    order = {"shared": 0, "unique": 1, "busy": 2}
    for row in sorted(rows, key=lambda r: (order.get(r["workload"], 3), r["batching"], not r["prefix_caching"],
                                           r.get("keeping_rows", 0))):
        lines.append(f"| {row['batching']} | {'on' if row['prefix_caching'] else 'off'} | {row.get('keeping_rows', 0)}"
                     f" | {row['workload']} | "
                     f"{row['prompt_tokens_mean']} | {row['ttft_p50_ms']} ms | {row['ttft_p99_ms']} ms | "
                     f"{100 * row['cached_share']:.1f} % | {row['output_tokens_per_s']} | {row['requests_per_s']} |")
    return lines
