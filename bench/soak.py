"""Scenario 9, soak: a steady arrival rate of streaming requests (TOKENBUS_SOAK_RATE per
second, open loop) against the whole stack for a bounded time (TOKENBUS_SOAK_S, default
600 s), sampling every process's memory, throughput and latency every 10 s. The run should
end with zero failed requests, flat memory for every tokenbus process and flat latency.

``TOKENBUS_SOAK_RATE=0`` runs the saturating variant instead: 16 clients back to back, as
fast as the machine serves them (what RELIABILITY.md's broker limit was measured with)."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.plots import plot_soak
from bench.stack import MODEL, bench_stack, cpu_seconds, process_rss_kib
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.loadgen import RequestResult, client_session, stream_chat

SIM = SimulatedEngineSettings(seed=5, ttft_ms=20, tokens_per_s=100, min_tokens=16, max_tokens=48)
SATURATING_CLIENTS = 16
SAMPLE_EVERY_S = 10.0


def duration_s() -> float:
    return float(os.environ.get("TOKENBUS_SOAK_S", "600"))


def arrival_rate() -> float:
    return float(os.environ.get("TOKENBUS_SOAK_RATE", "8"))


class SoakLoad:
    """Sends requests and keeps per-window counts and time-to-first-token."""

    def __init__(self, stack, stop_at: float) -> None:
        self.url = f"{stack.edge_url}/v1/chat/completions"
        self.headers = {"Authorization": f"Bearer {stack.dev_key}"}
        self.stop_at = stop_at
        self.ok = self.failed = 0
        self.errors: dict[str, int] = {}
        self.window_ttft_ms: list[float] = []
        self.sent = 0

    async def one(self, http: aiohttp.ClientSession) -> None:
        self.sent += 1
        payload = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": f"soak {self.sent}"}]}
        result: RequestResult = await stream_chat(http, self.url, payload, self.headers)
        if result.success:
            self.ok += 1
            self.window_ttft_ms.append(result.ttft * 1000)
        else:
            self.failed += 1
            self.errors[result.error[:80]] = self.errors.get(result.error[:80], 0) + 1

    async def steady(self, http: aiohttp.ClientSession, rate: float) -> None:
        """Open loop: one request every 1/rate s whatever the answers do (a backlog shows as latency)."""
        in_flight: set[asyncio.Task[None]] = set()
        next_at = time.monotonic()
        while next_at < self.stop_at:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            task = asyncio.create_task(self.one(http))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            next_at += 1 / rate
        await asyncio.gather(*in_flight)

    async def saturating(self, http: aiohttp.ClientSession) -> None:
        async def client() -> None:
            while time.monotonic() < self.stop_at:
                await self.one(http)
        await asyncio.gather(*(client() for _ in range(SATURATING_CLIENTS)))


async def soak(stack, seconds: float, rate: float) -> dict[str, Any]:
    pids = {name: p.pid for name, p in stack.processes.items() if p.pid}
    started = time.monotonic()
    load = SoakLoad(stack, started + seconds)
    samples: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def sampler() -> None:
        completed = 0
        cpu_before, clock_before = {n: cpu_seconds(pid) for n, pid in pids.items()}, time.monotonic()
        while not done.is_set():
            ttft, load.window_ttft_ms = load.window_ttft_ms, []
            cpu_now, clock_now = {n: cpu_seconds(pid) for n, pid in pids.items()}, time.monotonic()
            window_s = max(clock_now - clock_before, 1e-3)
            samples.append({
                "t_s": round(time.monotonic() - started, 1), "requests": load.ok, "failed": load.failed,
                "completed_in_window": load.ok - completed,
                "ttft_p50_ms": round(statistics.median(ttft), 1) if ttft else None,
                "ttft_p99_ms": round(statistics.quantiles(ttft, n=100)[98], 1) if len(ttft) > 1 else None,
                "rss_mib": {n: round(process_rss_kib(pid) / 1024, 1) for n, pid in pids.items()},
                # share of one core each process used over the window: where a drift's time goes
                "cpu_pct": {n: round(100 * (cpu_now[n] - cpu_before[n]) / window_s, 1) for n in pids}})
            completed = load.ok
            cpu_before, clock_before = cpu_now, clock_now
            try:
                await asyncio.wait_for(done.wait(), SAMPLE_EVERY_S)
            except TimeoutError:
                pass

    async with client_session(256, timeout_s=60) as http:
        sampling = asyncio.create_task(sampler())
        await (load.steady(http, rate) if rate > 0 else load.saturating(http))
        done.set()
        await sampling
    return {"counts": {"ok": load.ok, "failed": load.failed}, "errors": load.errors, "samples": samples}


def growth(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process: RSS at the first sample after warm-up (a quarter in), at the end, and the change."""
    warm = samples[len(samples) // 4]
    last = samples[-1]
    return {name: {"warm_mib": warm["rss_mib"][name], "end_mib": last["rss_mib"][name],
                   "max_mib": max(s["rss_mib"][name] for s in samples),
                   "change_mib": round(last["rss_mib"][name] - warm["rss_mib"][name], 1)} for name in last["rss_mib"]}


def latency_drift(samples: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median of the windows' TTFT p50 in the first and the last quarter of the run, and in its
    first and last minute."""
    windows = [s["ttft_p50_ms"] for s in samples if s["ttft_p50_ms"] is not None]
    if len(windows) < 4:
        return {"first_quarter_ms": None, "last_quarter_ms": None, "first_minute_ms": None, "last_minute_ms": None}
    quarter = len(windows) // 4
    minute = max(1, int(60 / SAMPLE_EVERY_S))
    return {"first_quarter_ms": statistics.median(windows[:quarter]),
            "last_quarter_ms": statistics.median(windows[-quarter:]),
            "first_minute_ms": statistics.median(windows[:minute]),
            "last_minute_ms": statistics.median(windows[-minute:])}


def cpu_drift(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process: its mean share of a core in the first and the last quarter of the run."""
    measured = [s for s in samples[1:] if "cpu_pct" in s]  # the first sample has no window before it
    quarter = max(1, len(measured) // 4)
    return {name: {"first_quarter_pct": round(statistics.fmean(s["cpu_pct"][name] for s in measured[:quarter]), 1),
                   "last_quarter_pct": round(statistics.fmean(s["cpu_pct"][name] for s in measured[-quarter:]), 1)}
            for name in (measured[0]["cpu_pct"] if measured else {})}


def run() -> dict[str, Any]:
    seconds, rate = duration_s(), arrival_rate()
    with bench_stack(SIM) as stack:
        result = asyncio.run(soak(stack, seconds, rate))
    result.update(scenario="soak", seconds=seconds, rate=rate, engine=SIM.model_dump(),
                  memory=growth(result["samples"]), ttft_p50=latency_drift(result["samples"]),
                  cpu=cpu_drift(result["samples"]))
    return result


def plot(result: dict[str, Any], out_dir: Path) -> Path:
    return plot_soak(result["samples"], out_dir / "soak.png")


def table(result: dict[str, Any]) -> str:
    c = result["counts"]
    load = (f"{result['rate']:g} requests/s (open loop)" if result["rate"] > 0
            else f"{SATURATING_CLIENTS} clients back to back")
    drift = result["ttft_p50"]
    lines = [f"{result['seconds']:.0f} s at {load}: {c['ok']} requests completed, {c['failed']} failed "
             f"{result['errors'] or ''}",
             f"TTFT p50 (median of 10 s windows): {drift['first_quarter_ms']} ms in the first quarter, "
             f"{drift['last_quarter_ms']} ms in the last; {drift.get('first_minute_ms')} ms in the first minute, "
             f"{drift.get('last_minute_ms')} ms in the last", "",
             "| process | RSS after warm-up MiB | at the end MiB | max MiB | change MiB | CPU first quarter % | last % |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in result["memory"].items():
        cpu = result.get("cpu", {}).get(name, {})
        lines.append(f"| {name} | {m['warm_mib']} | {m['end_mib']} | {m['max_mib']} | {m['change_mib']:+.1f} "
                     f"| {cpu.get('first_quarter_pct', '')} | {cpu.get('last_quarter_pct', '')} |")
    return "\n".join(lines)
