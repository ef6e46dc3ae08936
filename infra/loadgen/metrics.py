"""Summaries with the names and definitions of vLLM's serving benchmark."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenbus.infra.loadgen.results import RequestResult

DEFAULT_PERCENTILES = (99.0,)


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    out = {
        "mean": statistics.fmean(ms) if ms else 0.0,
        "median": percentile(ms, 50),
        "std": statistics.pstdev(ms) if ms else 0.0,
    }
    for pct in percentiles:
        out[f"p{pct:g}"] = percentile(ms, pct)
    return out


@dataclass
class Slo:
    """Goodput thresholds in ms, as ``--goodput ttft:MS tpot:MS e2el:MS``."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str]) -> Slo:
        slo = cls()
        for item in items:
            name, _, value = item.partition(":")
            if name not in {"ttft", "tpot", "e2el"} or not value:
                raise ValueError(f"goodput takes ttft:MS, tpot:MS or e2el:MS, not {item!r}")
            setattr(slo, f"{name}_ms", float(value))
        return slo

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def met_by(self, r: RequestResult) -> bool:
        if self.ttft_ms is not None and r.ttft * 1000 > self.ttft_ms:
            return False
        if self.tpot_ms is not None and (r.tpot or 0) * 1000 > self.tpot_ms:
            return False
        return self.e2el_ms is None or r.latency * 1000 <= self.e2el_ms


@dataclass
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    request_goodput: float | None = None
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    results: list[RequestResult],
    duration_s: float,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    slo: Slo | None = None,
) -> Summary:
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = r.error.split(":")[0][:80] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    goodput = None
    if slo is not None and not slo.empty:
        goodput = sum(1 for r in ok if slo.met_by(r)) / duration
    return Summary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=distribution_ms([r.ttft for r in ok], percentiles),
        tpot_ms=distribution_ms([t for r in ok if (t := r.tpot) is not None], percentiles),
        itl_ms=distribution_ms([gap for r in ok for gap in r.itl], percentiles),
        e2el_ms=distribution_ms([r.latency for r in ok], percentiles),
        request_goodput=goodput,
        errors=errors,
    )


METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
DEFAULT_METRICS = ("ttft", "tpot", "itl")  # vLLM's --percentile-metrics default


def _pct_word(stat: str) -> str:
    """``p99.0`` -> ``p99``, ``p99.9`` stays: how vLLM names a percentile key."""
    value = float(stat[1:])
    return f"p{int(value)}" if value == int(value) else f"p{value}"


def vllm_metrics(s: Summary, metrics: tuple[str, ...] = DEFAULT_METRICS) -> dict[str, Any]:
    """The flat keys of a vLLM result file (``median_ttft_ms``, ``p99_itl_ms``, ...)."""
    out: dict[str, Any] = {
        "duration": s.duration_s,
        "completed": s.completed,
        "total_input_tokens": s.total_input_tokens,
        "total_output_tokens": s.total_output_tokens,
        "request_throughput": s.request_throughput,
        "request_goodput": s.request_goodput,
        "output_throughput": s.output_throughput,
        "total_token_throughput": s.total_token_throughput,
    }
    for name in metrics:
        dist: dict[str, float] = getattr(s, f"{name}_ms")
        out[f"mean_{name}_ms"] = dist["mean"]
        out[f"median_{name}_ms"] = dist["median"]
        out[f"std_{name}_ms"] = dist["std"]
        for stat, value in dist.items():
            if stat.startswith("p"):
                out[f"{_pct_word(stat)}_{name}_ms"] = value
    return out


def format_summary(title: str, s: Summary, metrics: tuple[str, ...] = DEFAULT_METRICS) -> str:
    """vLLM's printed summary, and the failures by reason when there are any."""
    row = "{:<40} {:<10}".format
    lines = [
        f"{title:=^50}",
        row("Successful requests:", s.completed),
        row("Failed requests:", s.failed),
        row("Benchmark duration (s):", f"{s.duration_s:.2f}"),
        row("Total input tokens:", s.total_input_tokens),
        row("Total generated tokens:", s.total_output_tokens),
        row("Request throughput (req/s):", f"{s.request_throughput:.2f}"),
    ]
    if s.request_goodput is not None:
        lines.append(row("Request goodput (req/s):", f"{s.request_goodput:.2f}"))
    lines += [
        row("Output token throughput (tok/s):", f"{s.output_throughput:.2f}"),
        row("Total Token throughput (tok/s):", f"{s.total_token_throughput:.2f}"),
    ]
    for name in metrics:
        label, header = METRIC_HEADERS[name]
        dist = getattr(s, f"{name}_ms")
        lines.append(f"{header:-^50}")
        lines.append(row(f"Mean {label} (ms):", f"{dist['mean']:.2f}"))
        lines.append(row(f"Median {label} (ms):", f"{dist['median']:.2f}"))
        for stat, value in dist.items():
            if stat.startswith("p"):
                lines.append(row(f"P{_pct_word(stat)[1:]} {label} (ms):", f"{value:.2f}"))
    if s.errors:
        lines.append(f"{'Failures by reason':-^50}")
        for reason, count in sorted(s.errors.items(), key=lambda item: -item[1]):
            lines.append(row(f"{reason[:39]}:", count))
    lines.append("=" * 50)
    return "\n".join(lines)
