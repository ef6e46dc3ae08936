"""KV-cache-aware routing: many conversations sharing a few long system prompts, against several GPU
consumers whose engines keep a prefix cache, through two edges of one stack: one places requests
where their prefix is cached (the default), the other by key (``TOKENBUS_PREFIX_ROUTING=false``),
each conversation's own, or (``cache_key``) the ``prompt_cache_key`` its client names, here its
system prompt's name, as OpenAI's guide asks of clients. Rounds take the three in turn, each round
with system prompts of its own, so no round inherits another's cache. Per mode: TTFT p50/p99, the share of
prompt tokens served from cache, requests per consumer (the busiest over the mean), how the router
decided, and what billing charged (read back from the usage rollups, a tenant per mode).

Three runs: ``simulated`` (its prefix-cache model: uncached prompt tokens prefill at a set rate)
on three consumers; ``hf`` (SmolLM2-135M on the CPU, transformers' shared blocks) on two; and
``hf-slots``, the same with slot batching (its default on CUDA), two slots a consumer, whose cache
is what the slots keep.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.stack import MODEL, raise_open_file_limit, sim_env
from tokenbus.gpu_consumers.engines import GenerationInput, SimulatedEngineSettings
from tokenbus.gpu_consumers.engines.simulated_prompts import PrefixCacheModel
from tokenbus.gpu_consumers.prefix_reports import TRACKED_PREFIXES, PrefixReports
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack, StackSettings
from tokenbus.infra.loadgen.metrics import percentile
from tokenbus.infra.loadgen.results import RequestResult
from tokenbus.infra.loadgen.sse_client import client_session, stream_chat
from tokenbus.producers import PrefixIndex
from tokenbus.schemas import AvroCodec, CachedPrefix, CacheReport, ChatMessage, ChatRequest, Completion
from tokenbus.topics import TopicCatalog, make_consumer, topic_partitions

MODES = ("key", "prefix", "cache_key")
# Each consumer's cache holds about two of a round's system prompts: by key every consumer sees
# all of them and evicts, by prefix each keeps its own. An uncached prompt prefills in ~300 ms.
SIM = SimulatedEngineSettings(seed=7, ttft_ms=10, tokens_per_s=100, min_tokens=8, max_tokens=8, kv_block_tokens=16,
                              prefix_cache_tokens=3_000, prefill_tokens_per_s=4_000)
SHAPES = {
    # engine, consumers, system prompts per round, words per prompt, requests per round, concurrency, rounds
    "simulated": dict(engine="simulated", consumers=3, prompts=6, words=1_200, requests=150, concurrency=8, rounds=6),
    # SmolLM2's 64 cache blocks of 32 tokens on the CPU hold two of these prompts per consumer ...
    "hf": dict(engine="hf", consumers=2, prompts=4, words=550, requests=24, concurrency=2, rounds=3),
    # ... as two slots do (a slot keeps one prompt).
    "hf-slots": dict(engine="hf", consumers=2, prompts=4, words=550, requests=24, concurrency=2, rounds=3,
                     env={"TOKENBUS_HF_BATCHING": "slots", "TOKENBUS_HF_MAX_MODEL_LEN": "1024",
                          "TOKENBUS_WORKER_MAX_NUM_SEQS": "2"}),
}


def system_prompt(round_no: int, index: int, words: int) -> str:
    rng = random.Random(f"{round_no}:{index}")
    vocabulary = "policy answer customer order refund shipping account billing tone brief cite source".split()
    return f"You are assistant {round_no}-{index}. " + " ".join(rng.choice(vocabulary) for _ in range(words))


@contextlib.contextmanager
def routing_stack(engine: str, consumers: int, engine_env: dict[str, str]) -> Iterator[tuple[EmbeddedStack, str]]:
    """A stack with ``consumers`` GPU consumers and a second edge that places by key; yields the
    stack and that edge's address."""
    raise_open_file_limit()
    with tempfile.TemporaryDirectory(prefix="tokenbus-bench-") as tmp:
        settings = StackSettings(run_root=Path(tmp), broker_port=free_port(), edge_port=free_port(),
                                 worker_port=free_port(), processors_port=free_port(), engine=engine,
                                 topic_prefix=f"bench{uuid.uuid4().hex[:6]}.", models=[MODEL])
        env = {**sim_env(SIM), "TOKENBUS_EDGE_MAX_QUEUE_DEPTH": "interactive:1000000,standard:1000000,batch:1000000",
               "TOKENBUS_PROC_BILLING_BATCH_S": "0.2", "TOKENBUS_HF_CPU_THREADS": "1", **engine_env}
        stack = EmbeddedStack(settings, extra_env=env)
        try:
            stack.start()
            for n in range(2, consumers + 1):
                stack.start_worker(f"gpu-consumer-{n}", free_port())
            key_port = free_port()
            stack.start_edge("edge-by-key", key_port, reply_partitions="1", env={"TOKENBUS_PREFIX_ROUTING": "false"})
            time.sleep(12)  # every consumer has joined and sent its first cache report
            yield stack, f"http://{settings.host}:{key_port}"
        finally:
            stack.stop()


async def run_round(base_url: str, key: str, round_no: int, shape: dict[str, Any],
                    cache_keys: bool) -> list[tuple[str, RequestResult]]:
    """A round's requests; with ``cache_keys``, each names its system prompt as its ``prompt_cache_key``."""
    prompts = [system_prompt(round_no, i, shape["words"]) for i in range(shape["prompts"])]
    rng = random.Random(round_no)
    work = [(f"r{round_no}-c{n}", rng.randrange(len(prompts))) for n in range(shape["requests"])]
    results: list[tuple[str, RequestResult]] = []
    headers = {"Authorization": f"Bearer {key}"}

    async def client(http: aiohttp.ClientSession) -> None:
        while work:
            conversation, system = work.pop()
            payload = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 8,
                       "messages": [{"role": "system", "content": prompts[system]},
                                    {"role": "user", "content": f"question from {conversation}"}]}
            if cache_keys:
                payload["prompt_cache_key"] = f"system-{round_no}-{system}"
            started = time.time()
            result = await stream_chat(http, f"{base_url}/v1/chat/completions", payload, headers)
            results.append((conversation, result))
            if not result.success:
                print(f"  failed after {time.time() - started:.1f} s: {result.error}")

    async with client_session(64, timeout_s=120) as http:
        await asyncio.gather(*(client(http) for _ in range(shape["concurrency"])))
    return results


async def read_topic(stack: EmbeddedStack, topic: str, enough: int, quiet_s: float = 2.0) -> list[Any]:
    """Every record of ``topic``: until ``enough`` came, or none for ``quiet_s``."""
    consumer = make_consumer(stack.bus_settings())
    await consumer.start()
    records: list[Any] = []
    try:
        consumer.assign(await topic_partitions(consumer, topic))
        await consumer.seek_to_beginning()
        quiet_since = time.time()
        while len(records) < enough and time.time() - quiet_since < quiet_s:
            batches = await consumer.getmany(timeout_ms=500)
            for batch in batches.values():
                records += batch
            if batches:
                quiet_since = time.time()
    finally:
        await consumer.stop()
    return records


async def completions_by_request(stack: EmbeddedStack, expected: int) -> dict[str, Completion]:
    codec = AvroCodec()
    records = await read_topic(stack, TopicCatalog(stack.bus_settings()).completions, expected, quiet_s=30)
    return {c.request_id: c for c in (codec.decode(r.value, Completion) for r in records)}


async def report_traffic(stack: EmbeddedStack, since_ms: int, until_ms: int) -> dict[str, float]:
    """What the consumers' cache reports cost the bus while the rounds ran."""
    records = await read_topic(stack, TopicCatalog(stack.bus_settings()).cache_reports, 10**9)
    during = [r for r in records if since_ms <= r.timestamp <= until_ms]
    seconds = max((until_ms - since_ms) / 1000, 1e-9)
    return {"reports_per_s": round(len(during) / seconds, 1),
            "report_bytes_per_s": round(sum(len(r.value) for r in during) / seconds)}


def placement_cost_us(workers: int = 4, prefixes_per_worker: int = 5_000, messages: int = 8) -> float:
    """CPU time of one placement decision against a busy index, in process."""
    index = PrefixIndex(stale_after_s=30)
    rng = random.Random(1)
    for w in range(workers):
        stored = [CachedPrefix(rng.getrandbits(63), 512) for _ in range(prefixes_per_worker)]
        index.apply(CacheReport(f"w{w}", MODEL, 1, 0, snapshot=True, stored=stored,
                                partitions=[("t", 2 * w), ("t", 2 * w + 1)], running=w), 0.0)
    requests = [ChatRequest(f"r{i}", MODEL, "standard", [ChatMessage("user", f"message {j} " * 200)
                                                          for j in range(messages - 1)] + [ChatMessage("user", str(i))],
                            "tokens", 0, conversation_id=f"c{i}") for i in range(2_000)]
    started = time.process_time()
    for request in requests:
        index.place(request, "t", 0.0)
    return round((time.process_time() - started) / len(requests) * 1e6, 1)


def report_check_cost_us(watched: int = TRACKED_PREFIXES, reports: int = 100) -> dict[str, float]:
    """CPU time a busy worker's cache report spends checking which prefixes its engine holds, with
    ``watched`` prefixes watched (the most it keeps): every one of them, as each report did before
    and a snapshot still does, against a report's share 100 ms after the one before, in process."""

    async def measure() -> dict[str, float]:
        cache = PrefixCacheModel(watched * 2 * 16, 16)
        reports_ = PrefixReports(cache, None, "w", MODEL, lambda: (256, 0), report_interval_ms=100, snapshot_interval_s=10)
        for i in range(watched):  # a conversation: one of 50 system prompts and its first turn
            request = ChatRequest(f"r{i}", MODEL, "standard", [ChatMessage("system", f"system {i % 50} " * 20),
                                                               ChatMessage("user", f"question {i} " * 20)], "tokens", 0)
            given = GenerationInput.from_request(request)
            cache.admit(cache.layout(given).block_hashes, 80)
            reports_.admitted(request, given)
        loop = asyncio.get_running_loop()
        costs = {}
        for name, everything in (("every_prefix", True), ("a_reports_share", False)):
            used = 0.0
            for _ in range(reports):
                reports_._checked_at = loop.time() - 0.1  # the report before, 100 ms ago
                started = time.process_time()
                reports_.check(everything=everything)
                used += time.process_time() - started
            costs[name] = round(used / reports * 1e6, 1)
        return {"watched": reports_.watched, **costs}

    return asyncio.run(measure())


def billed(stack: EmbeddedStack, tenants: dict[str, str], expected: dict[str, int]) -> dict[str, dict[str, int]]:
    """Requests, tokens and cost (nano-USD) billing wrote per tenant, once every request is in."""
    totals: dict[str, dict[str, int]] = {}
    deadline = time.time() + 60
    for mode, tenant in tenants.items():
        while True:
            rows = httpx.get(f"{stack.processors_url}/usage", params={"bucket": "day", "tenant": tenant},
                             timeout=30).json()["rows"]
            sums = {k: sum(r[k] for r in rows) for k in ("requests", "prompt_tokens", "cached_prompt_tokens",
                                                         "input_cost_nanousd", "output_cost_nanousd")}
            if sums["requests"] >= expected[mode] or time.time() > deadline:
                totals[mode] = sums
                break
            time.sleep(0.5)
    return totals


def summarize(results: list[tuple[str, RequestResult]], completions: dict[str, Completion],
              ids: dict[str, str]) -> dict[str, Any]:
    ok = [r for _, r in results if r.success]
    ttft = [r.ttft * 1000 for r in ok]
    per_worker = Counter(completions[ids[c]].worker_id for c, r in results if r.success and ids.get(c) in completions)
    routes = Counter(completions[ids[c]].annotations.get("route", "key") for c, r in results
                     if r.success and ids.get(c) in completions)
    mean = sum(per_worker.values()) / max(1, len(per_worker))
    prompt = sum(r.prompt_tokens for r in ok)
    return {"requests": len(results), "failed": len(results) - len(ok),
            "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p99_ms": round(percentile(ttft, 99), 1),
            "cached_share": round(sum(r.cached_tokens for r in ok) / max(1, prompt), 3),
            "requests_with_hit": round(sum(1 for r in ok if r.cached_tokens) / max(1, len(ok)), 3),
            "per_consumer": dict(sorted(per_worker.items())),
            "busiest_over_mean": round(max(per_worker.values(), default=0) / max(mean, 1e-9), 2),
            "routes": dict(routes)}


def measure(name: str) -> dict[str, Any]:
    shape = SHAPES[name]
    with routing_stack(shape["engine"], shape["consumers"], shape.get("env", {})) as (stack, key_edge):
        tenants = {mode: f"bench-{mode}-{uuid.uuid4().hex[:4]}" for mode in MODES}
        keys = {mode: asyncio.run(stack.create_key(tenant, "standard")) for mode, tenant in tenants.items()}
        edges = {"key": key_edge, "prefix": stack.edge_url, "cache_key": key_edge}
        results: dict[str, list[tuple[str, RequestResult]]] = {mode: [] for mode in MODES}
        began_ms = int(time.time() * 1000)
        for round_no in range(shape["rounds"]):
            mode = MODES[round_no % len(MODES)]
            results[mode] += asyncio.run(run_round(edges[mode], keys[mode], round_no, shape, mode == "cache_key"))
        traffic = asyncio.run(report_traffic(stack, began_ms, int(time.time() * 1000)))
        ids = {c: r.response_id for mode in MODES for c, r in results[mode] if r.response_id}
        completions = asyncio.run(completions_by_request(stack, len(ids)))
        bills = billed(stack, tenants, {mode: len(results[mode]) for mode in MODES})
    rows = []
    for mode in MODES:
        row = {"mode": mode, **summarize(results[mode], completions, ids), **bills[mode]}
        row["cost_usd"] = (row["input_cost_nanousd"] + row["output_cost_nanousd"]) / 1e9
        rows.append(row)
    return {**shape, "engine": name, "rows": rows, **traffic}


def run() -> dict[str, Any]:
    return {"scenario": "prefix_routing", "simulated_engine": SIM.model_dump(),
            "placement_us": placement_cost_us(), "report_check_us": report_check_cost_us(),
            "runs": [measure(name) for name in SHAPES]}


def table(result: dict[str, Any]) -> str:
    lines = [f"placement decision: {result['placement_us']} µs of CPU (4 consumers holding 5,000 prefixes each, "
             "8-message prompts)"]
    checks = result["report_check_us"]
    lines += ["", f"a cache report's check of what the engine holds, {checks['watched']:,} prefixes watched: "
                  f"{checks['a_reports_share']} µs of CPU (every prefix, as each report did before and a snapshot "
                  f"does: {checks['every_prefix']} µs)"]
    for run_ in result["runs"]:
        lines += ["", f"{run_['engine']} engine, {run_['consumers']} consumers, {run_['prompts']} system prompts of "
                      f"~{run_['words']} words per round, {run_['requests']} requests per round at concurrency "
                      f"{run_['concurrency']}, {run_['rounds']} rounds taking the placements in turn", "",
                  "| placement | done | failed | TTFT p50 | TTFT p99 | cached share | requests with a hit | busiest/mean "
                  "| billed cost (USD) | routes |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in run_["rows"]:
            routes = ", ".join(f"{k} {v}" for k, v in sorted(r["routes"].items()))
            lines.append(f"| {r['mode']} | {r['requests'] - r['failed']} | {r['failed']} | {r['ttft_p50_ms']} | "
                         f"{r['ttft_p99_ms']} | {r['cached_share']:.1%} | {r['requests_with_hit']:.0%} | "
                         f"{r['busiest_over_mean']} | {r['cost_usd']:.6f} | {routes} |")
        lines += ["", f"cache reports while the rounds ran: {run_['reports_per_s']}/s, "
                      f"{run_['report_bytes_per_s']} bytes/s"]
    return "\n".join(lines)
