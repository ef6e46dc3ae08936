"""Scenario 6, GPU consumer throughput: at saturation, the tokens/s one consumer delivers to
Kafka (requests from a backlog on the bus, every token event published and acknowledged)
against the tokens/s the same engine produces alone, in the same run.

The engine is `simulated` by default; on a GPU host, `TOKENBUS_BENCH_ENGINE=hf` runs the
transformers engine on CUDA (model from TOKENBUS_HF_MODEL_PATH, else SmolLM2-135M-Instruct, and the
other `TOKENBUS_HF_*` settings). The sizes default per engine and can be set:
`TOKENBUS_BENCH_MAX_NUM_SEQS`, `TOKENBUS_BENCH_REQUESTS`, `TOKENBUS_BENCH_OUTPUT_TOKENS`, and for the
simulated engine `TOKENBUS_BENCH_SIM_TOKENS_PER_S` (per sequence): 256 sequences at 200 tokens/s
offer the 51,200 tokens/s of a TensorRT-LLM-class GPU, and `TOKENBUS_BENCH_OUTPUT_RANGE_RATIO`
(vLLM's `--random-range-ratio`: each output uniform within that fraction of
`TOKENBUS_BENCH_OUTPUT_TOKENS` either side; 0, the default, ends every sequence of a wave in the
same step, the consumer's worst case for turnovers). It needs the broker only (no Redis).

The simulated engine runs on the consumer's event loop, so a consumer that falls behind also
holds the engine back: a late step makes up one step at most. The consumer is measured that way
(every token its own event unless the consumer merges) and, on a reply partition of its own, with
the engine making up every step it missed (``catch_up_all``), as an engine that generates apart
from the loop does (TensorRT-LLM's executor, the hf engine's thread): there a consumer that falls
behind finds several steps waiting and sends them as one event, so the second row says what a
busy consumer costs such an engine's streams in tokens per event rather than in tokens/s.

The simulated engine pushes each step to the worker where it makes it, as the hf engine does
(``each_step``: no task wakes per token). TensorRT-LLM's LLM API gives a per-request iterator
instead, read by a task per request: the third row runs the engine apart that way
(``push_steps`` off), for what a consumer keeps up with behind TensorRT-LLM.

Each consumer run also counts its garbage collector's passes and the longest of them: a pass
stops the loop, and every stream with it."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any, NamedTuple

from aiokafka import TopicPartition

from bench.baselines import engine_sender
from bench.stack import MODEL, bench_stack
from tokenbus.gpu_consumers.engines import Engine, SimulatedEngine, SimulatedEngineSettings
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.gpu_consumers.worker import GpuWorker
from tokenbus.infra.loadgen import run_load
from tokenbus.infra.loadgen.metrics import percentile
from tokenbus.infra.loadgen.prompts import synthetic_prompts
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import AvroCodec, ChatMessage, TokenEvent
from tokenbus.topics import BusSettings, TopicCatalog, make_consumer
from tokenbus.topics.collector import tune_collector
from tokenbus.topics.event_loops import loop_factory

REPLY_PARTITION = 3
ENGINE_APART_REPLY_PARTITION = 4  # the second run's, so that each reads back only its own tokens
READ_PER_REQUEST_REPLY_PARTITION = 5  # the third's
# (max_num_seqs, requests, output tokens): a real model on a CPU gets a smaller run.
SIZES = {"simulated": (64, 512, 64), "hf": (16, 64, 32)}


def engine_name() -> str:
    return os.environ.get("TOKENBUS_BENCH_ENGINE", "simulated")


def sized(name: str, default: int) -> int:
    return int(os.environ.get(f"TOKENBUS_BENCH_{name}", default))


_seqs, _requests, _tokens = SIZES[engine_name()]
MAX_NUM_SEQS = sized("MAX_NUM_SEQS", _seqs)
REQUESTS = sized("REQUESTS", _requests)
OUTPUT_TOKENS = sized("OUTPUT_TOKENS", _tokens)
RANGE_RATIO = float(os.environ.get("TOKENBUS_BENCH_OUTPUT_RANGE_RATIO", 0))
SHORTEST, LONGEST = round(OUTPUT_TOKENS * (1 - RANGE_RATIO)), round(OUTPUT_TOKENS * (1 + RANGE_RATIO))
SIM = SimulatedEngineSettings(seed=6, ttft_ms=5, tokens_per_s=sized("SIM_TOKENS_PER_S", 100), min_tokens=SHORTEST,
                              max_tokens=LONGEST)


def make_engine(sim: SimulatedEngineSettings = SIM) -> Engine:
    if engine_name() == "hf":
        from tokenbus.gpu_consumers.engines.hf import HfEngine
        from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings

        # Greedy decoding runs each prompt to its natural end; the cap keeps every request to OUTPUT_TOKENS.
        settings = HfEngineSettings()
        return HfEngine(settings.model_copy(update={"default_max_tokens": OUTPUT_TOKENS}), max_num_seqs=MAX_NUM_SEQS)
    return SimulatedEngine(sim)


async def engine_alone() -> dict[str, float]:
    engine = make_engine()
    await engine.start()
    try:
        prompts = synthetic_prompts(REQUESTS, 16, LONGEST, seed=6)  # the engine picks each length
        cpu = time.process_time()
        results, duration = await run_load(engine_sender(engine), prompts, max_concurrency=MAX_NUM_SEQS)
        cpu = time.process_time() - cpu
    finally:
        await engine.close()
    tokens = sum(r.output_tokens for r in results)
    return {"tokens": tokens, "seconds": round(duration, 3), "tokens_per_s": round(tokens / duration, 1),
            "tokens_per_event": round(tokens / max(sum(r.chunks for r in results), 1), 3),
            "cpu_us_per_token": round(cpu / tokens * 1e6, 2)}


class CollectorPasses:
    """The garbage collector's passes while it is entered: how many, their time in all and the
    longest (ms, wall time). A pass stops the event loop, and every stream the consumer serves
    with it; a consumer whose requests are freed by reference counting makes few and short ones."""

    def __init__(self) -> None:
        self.passes = 0
        self.seconds = self.longest = 0.0
        self._started = 0.0

    def __enter__(self) -> CollectorPasses:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.passes += 1
        self.seconds += took
        self.longest = max(self.longest, took)

    def figures(self) -> dict[str, float]:
        return {"passes": self.passes, "ms": round(self.seconds * 1000, 1), "longest_ms": round(self.longest * 1000, 1)}


async def through_consumer(bus: BusSettings, sim: SimulatedEngineSettings = SIM,
                           reply_partition: int = REPLY_PARTITION) -> dict[str, float]:
    """Publish a backlog, let the consumer drain it, then read what it delivered back from the log:
    its span is measured by the producer timestamps of the token records, so no reader competes
    with the consumer for the CPU while it runs."""
    async with TokenbusClient(bus, reply_partitions=[reply_partition], idle_timeout=300) as client:
        for p in synthetic_prompts(REQUESTS, 16, LONGEST, seed=6):
            await client.publish(client.new_request(MODEL, [ChatMessage("user", p.text)], max_tokens=LONGEST))
    worker = GpuWorker(WorkerSettings(bus=bus, model=MODEL, max_num_seqs=MAX_NUM_SEQS, worker_id="bench"),
                       make_engine(sim))
    with CollectorPasses() as collector:
        cpu = time.process_time()
        run = asyncio.create_task(worker.run())
        while worker.completed < REQUESTS:
            await asyncio.sleep(0.05)
        cpu = time.process_time() - cpu
    worker.stop()
    await run
    delivered = await delivered_tokens(bus, reply_partition)
    # Every request of the backlog may have been served before the worker started: it is looked
    # up in the reply log first (gpu_consumers/token_log.py), which the worker writes meanwhile.
    # From admission to the first token: the engine's time to first token plus the consumer's own
    # part of a turnover (a wave's finals, completions, admissions), which its tail shows.
    ttft = delivered.latencies(set(delivered.admitted_ms))["ttft_ms"]
    return {**delivered.figures(), "cpu_us_per_token": round(cpu / max(delivered.tokens, 1) * 1e6, 2),
            "ttft_from_admission_ms": ttft, "token_log_records_read": worker.token_log.records_scanned,
            "collector": collector.figures()}


class Delivered(NamedTuple):
    """What a reply partition holds: its tokens, the token events that carried them, the first
    and last of those events' timestamps (ms), and per request when the consumer admitted it and
    when each of its events carrying tokens was made."""

    tokens: int
    events: int
    first_ms: int
    last_ms: int
    admitted_ms: dict[str, int]
    event_ms: dict[str, list[int]]

    def latencies(self, requests: set[str]) -> dict[str, dict[str, float]]:
        """For ``requests``: queue time (how long each waited after the consumer admitted its first:
        a backlog published before the consumer started), time to first token from admission, and
        the gaps between a request's token events, in ms (the events' clock is the millisecond)."""
        served = [r for r in requests if r in self.admitted_ms and self.event_ms.get(r)]
        began = min((self.admitted_ms[r] for r in served), default=0)
        gaps = [b - a for r in served for a, b in zip(self.event_ms[r], self.event_ms[r][1:])]

        def spread(values: list[float]) -> dict[str, float]:
            return {"median": percentile(values, 50), "p99": percentile(values, 99)}

        return {"queue_ms": spread([self.admitted_ms[r] - began for r in served]),
                "ttft_ms": spread([self.event_ms[r][0] - self.admitted_ms[r] for r in served]),
                "itl_ms": spread([float(g) for g in gaps])}

    def figures(self) -> dict[str, float]:
        seconds = (self.last_ms - self.first_ms) / 1000
        # Steps a reader finds waiting go out as one event (gpu_consumers/engines): under load
        # an event carries more than one token.
        return {"tokens": self.tokens, "seconds": round(seconds, 3),
                "tokens_per_s": round(self.tokens / max(seconds, 1e-9), 1),
                "tokens_per_event": round(self.tokens / max(self.events, 1), 3)}


async def delivered_tokens(bus: BusSettings, partition: int = REPLY_PARTITION) -> Delivered:
    """What the reply partition holds (see ``Delivered``)."""
    codec = AvroCodec()
    consumer = make_consumer(bus)
    await consumer.start()
    tp = TopicPartition(TopicCatalog(bus).tokens, partition)
    consumer.assign([tp])
    await consumer.seek_to_beginning(tp)
    tokens, stamps = 0, []  # a timestamp per event that carries tokens
    admitted: dict[str, int] = {}
    made: dict[str, list[int]] = {}
    try:
        while True:
            for record in (await consumer.getmany(tp, timeout_ms=300)).get(tp, []):
                event = codec.decode(record.value, TokenEvent)
                if event.admitted_at_ms is not None:
                    admitted[event.request_id] = event.admitted_at_ms
                if event.token_ids:
                    tokens += len(event.token_ids)
                    stamps.append(record.timestamp)
                    made.setdefault(event.request_id, []).append(event.created_at_ms)
            if consumer.highwater(tp) is not None and await consumer.position(tp) >= consumer.highwater(tp):
                return Delivered(tokens, len(stamps), min(stamps), max(stamps), admitted, made)
    finally:
        await consumer.stop()


def run() -> dict[str, Any]:
    with bench_stack(SIM, start_services=False, redis=False) as stack:
        # Each on the event loop and with the collector a GPU consumer process has.
        tune_collector(WorkerSettings().gc_threshold)
        with asyncio.Runner(loop_factory=loop_factory(WorkerSettings().loop)) as runner:
            alone = runner.run(engine_alone())
        with asyncio.Runner(loop_factory=loop_factory(WorkerSettings().loop)) as runner:
            consumer = runner.run(through_consumer(stack.bus_settings()))
        apart = read = None
        if engine_name() == "simulated":  # the hf engine generates in a thread of its own already
            with asyncio.Runner(loop_factory=loop_factory(WorkerSettings().loop)) as runner:
                apart = runner.run(through_consumer(stack.bus_settings(), SIM.model_copy(update={"catch_up_all": True}),
                                                        ENGINE_APART_REPLY_PARTITION))
            with asyncio.Runner(loop_factory=loop_factory(WorkerSettings().loop)) as runner:
                read = runner.run(through_consumer(
                    stack.bus_settings(), SIM.model_copy(update={"catch_up_all": True, "push_steps": False}),
                    READ_PER_REQUEST_REPLY_PARTITION))
    result = {"scenario": "consumer_throughput", "engine": engine_name(),
              "engine_settings": SIM.model_dump() if engine_name() == "simulated" else {},
              "max_num_seqs": MAX_NUM_SEQS, "requests": REQUESTS, "output_tokens": OUTPUT_TOKENS,
              "output_range_ratio": RANGE_RATIO,
              "engine_alone": alone, "through_consumer": consumer, "ratio": ratio(consumer, alone)}
    if apart is not None:
        result.update(through_consumer_engine_apart=apart, ratio_engine_apart=ratio(apart, alone),
                      through_consumer_read_per_request=read, ratio_read_per_request=ratio(read, alone))
    return result


def ratio(delivered: dict[str, float], alone: dict[str, float]) -> float:
    return round(delivered["tokens_per_s"] / max(alone["tokens_per_s"], 1e-9), 3)


def table(result: dict[str, Any]) -> str:
    a, c, apart = result["engine_alone"], result["through_consumer"], result.get("through_consumer_engine_apart")
    read = result.get("through_consumer_read_per_request")
    ratio_ = result.get("output_range_ratio", 0)
    spread = f" (each within {ratio_:.0%} of it either side)" if ratio_ else ""

    def row(path: str, r: dict[str, Any]) -> str:
        ttft, collector = r.get("ttft_from_admission_ms"), r.get("collector")
        ttft_cell = f"{ttft['median']:.0f} / {ttft['p99']:.0f}" if ttft else "-"
        collector_cell = f"{collector['passes']} / {collector['longest_ms']:.1f}" if collector else "-"
        return (f"| {path} | {r['tokens']} | {r['seconds']} | {r['tokens_per_s']} | {r.get('tokens_per_event', '-')} "
                f"| {r['cpu_us_per_token']} µs | {ttft_cell} | {collector_cell} |")

    lines = [
        f"engine `{result['engine']}`, {result['requests']} requests x {result['output_tokens']} tokens"
        f"{spread}, max_num_seqs {result['max_num_seqs']}", "",
        "| path | tokens | seconds | tokens/s | tokens per token event | process CPU per token "
        "| first token after admission p50 / p99 ms | collector passes / longest ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        row("engine alone", a),
        row("through the consumer, delivered to Kafka", c),
    ]
    if apart is not None:
        lines.append(row("the same, the engine making up every step the loop held it back from", apart))
    if read is not None:
        lines.append(row("the same, each request's steps read by its own task (as from TensorRT-LLM)", read))
    lines += ["", f"consumer / engine: **{result['ratio']:.3f}**"]
    if apart is not None:
        lines.append(f"(with the engine generating apart from the consumer's loop: {result['ratio_engine_apart']:.3f})")
    if read is not None:
        lines.append(f"(the same, each request's steps read by its own task: {result['ratio_read_per_request']:.3f})")
    lines += ["", f"reply-log records the backlog's lookups read: {c.get('token_log_records_read', 'not counted')}"]
    return "\n".join(lines)
