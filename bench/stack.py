"""An embedded stack for benchmarks: same code as `tokenbus up`, on free ports, in a temp dir."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import statistics
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack, StackSettings
from tokenbus.infra.loadgen import percentile
from tokenbus.infra.loadgen.serve import ServeConfig

MODEL = "tokenbus-sim"


def sim_env(settings: SimulatedEngineSettings) -> dict[str, str]:
    return {f"TOKENBUS_SIM_{k.upper()}": str(v) for k, v in settings.model_dump().items()}


def raise_open_file_limit() -> int:
    """Thousands of open streams need thousands of sockets; children inherit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


@contextlib.contextmanager
def bench_stack(sim: SimulatedEngineSettings, max_num_seqs: int = 256, extra_env: dict[str, str] | None = None,
                start_services: bool = True, unserved: tuple[str, ...] = (), redis: bool = True) -> Iterator[EmbeddedStack]:
    """A stack on free ports; without services it is only the bus (broker, Redis unless ``redis`` is
    false, topics). ``unserved`` models have topics but no GPU consumer."""
    raise_open_file_limit()
    with tempfile.TemporaryDirectory(prefix="tokenbus-bench-") as tmp:
        settings = StackSettings(
            run_root=Path(tmp),
            broker_port=free_port(),
            edge_port=free_port(),
            worker_port=free_port(),
            processors_port=free_port(),
            topic_prefix=f"bench{uuid.uuid4().hex[:6]}.",
            models=[MODEL, *unserved],
        )
        env = {**sim_env(sim), "TOKENBUS_WORKER_MAX_NUM_SEQS": str(max_num_seqs),
               # Benchmarks measure the pipeline, not admission control: no queue limit.
               "TOKENBUS_EDGE_MAX_QUEUE_DEPTH": "interactive:1000000,standard:1000000,batch:1000000",
               **(extra_env or {})}
        stack = EmbeddedStack(settings, extra_env=env)
        try:
            stack.start(unserved=unserved) if start_services else stack.start_bus(redis=redis)
            yield stack
        finally:
            stack.stop()


def serve_config(base_url: str, api_key: str, **overrides) -> ServeConfig:
    """Defaults every scenario shares: the stack's model, p50 and p99, no progress bar."""
    fields = dict(base_url=base_url, api_key=api_key, model=MODEL, percentiles=(50.0, 99.0), input_len=16,
                  progress=False)
    return ServeConfig(**{**fields, **overrides})


def process_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


SCHEDSTAT = Path("/proc/self/schedstat").exists()


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, all its threads: to the nanosecond from each thread's
    scheduler statistics where the kernel keeps them (a thread that ended takes its time with it:
    read around a call, a process whose threads live on, as the services' do), else in the clock
    ticks of its user and system time (10 ms)."""
    if not SCHEDSTAT:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    on_cpu_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # (a thread that ended just now)
            on_cpu_ns += int((task / "schedstat").read_text().split()[0])
    return on_cpu_ns / 1e9


def latency_and_cpu(measured: dict[str, dict[str, list[float]]], count: int, unit: str) -> dict[str, dict[str, float]]:
    """Each kind's latency (``latency``, ms: p50 and p99) and the edge's CPU time per ``unit``
    (``cpu``, seconds read around each of ``count`` calls: their sum over the count, in µs)."""
    return {kind: {"p50_ms": round(statistics.median(m["latency"]), 2), "p99_ms": round(percentile(m["latency"], 99), 2),
                   f"edge_cpu_us_per_{unit}": round(1e6 * sum(m["cpu"]) / count, 1)} for kind, m in measured.items()}


Measured = TypeVar("Measured")


def measure_edge(sim: SimulatedEngineSettings, measure: Callable[[str, str, int], Awaitable[Measured]]) -> Measured:
    """``measure(edge_url, api_key, edge_pid)``, run against a stack of its own."""
    with bench_stack(sim) as stack:
        edge_pid = stack.processes["edge"].pid
        assert edge_pid is not None
        return asyncio.run(measure(stack.edge_url, stack.dev_key, edge_pid))
