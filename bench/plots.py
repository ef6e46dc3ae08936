"""PNG charts written next to the JSON results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_load_sweep(rows: list[dict[str, Any]], path: Path) -> Path:
    rates = [r["rate"] for r in rows]
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4))
    latency.plot(rates, [r["ttft_p50"] for r in rows], "o-", label="TTFT p50")
    latency.plot(rates, [r["ttft_p99"] for r in rows], "o--", label="TTFT p99")
    latency.plot(rates, [r["itl_p50"] for r in rows], "s-", label="ITL p50")
    latency.plot(rates, [r["itl_p99"] for r in rows], "s--", label="ITL p99")
    latency.set(xlabel="offered load (req/s)", ylabel="ms", yscale="log", title="latency vs load")
    latency.legend()
    throughput.plot(rates, [r["request_throughput"] for r in rows], "o-", label="served")
    throughput.plot(rates, rates, ":", color="grey", label="offered")
    throughput.set(xlabel="offered load (req/s)", ylabel="req/s", title="throughput vs load")
    throughput.legend()
    return _save(fig, path)


def plot_fanout(levels: list[dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([lv["streams"] for lv in levels], [lv["edge_rss_mib"] for lv in levels], "o-")
    ax.set(xlabel="open SSE streams", ylabel="edge RSS (MiB)", title="one edge process: memory vs open streams")
    return _save(fig, path)


def plot_tiers(rows: list[dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    tiers = [r["tier"] for r in rows]
    x = range(len(tiers))
    ax.bar([i - 0.2 for i in x], [r["ttft_p50"] for r in rows], width=0.4, label="TTFT p50")
    ax.bar([i + 0.2 for i in x], [r["ttft_p99"] for r in rows], width=0.4, label="TTFT p99")
    ax.set_xticks(list(x), tiers)
    ax.set(ylabel="ms", title="TTFT per tier under 1.5x overload")
    ax.legend()
    return _save(fig, path)


def plot_soak(samples: list[dict[str, Any]], path: Path) -> Path:
    minutes = [s["t_s"] / 60 for s in samples]
    fig, (memory, served, latency) = plt.subplots(1, 3, figsize=(15, 4.5))
    for name in samples[0]["rss_mib"]:
        memory.plot(minutes, [s["rss_mib"][name] for s in samples], label=name)
    memory.set(xlabel="minutes", ylabel="RSS (MiB)", title="memory of every process")
    memory.legend(fontsize=8)
    # Each sample counts what completed since the one before; the last window can be shorter.
    gaps = [later["t_s"] - earlier["t_s"] for earlier, later in zip(samples, samples[1:])]
    served.plot(minutes[1:], [s["completed_in_window"] / gap for s, gap in zip(samples[1:], gaps)], label="completed")
    served.plot(minutes, [s.get("failed", 0) for s in samples], label="failed (total)")
    served.set(xlabel="minutes", ylabel="requests/s, failed count", title="requests completed per second")
    served.legend(fontsize=8)
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")):
        latency.plot(minutes, [s.get(key) for s in samples], label=label)
    latency.set(xlabel="minutes", ylabel="ms", title="time to first token per 10 s window")
    latency.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
