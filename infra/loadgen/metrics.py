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


def format_summary(title: str, s: Summary) -> str:
    lines = [
        f"{'=' * 18} {title} {'=' * 18}",
        f"{'Successful requests:':<40}{s.completed:>10}",
        f"{'Failed requests:':<40}{s.failed:>10}",
        f"{'Benchmark duration (s):':<40}{s.duration_s:>10.2f}",
        f"{'Total input tokens:':<40}{s.total_input_tokens:>10}",
        f"{'Total generated tokens:':<40}{s.total_output_tokens:>10}",
        f"{'Request throughput (req/s):':<40}{s.request_throughput:>10.2f}",
        f"{'Output token throughput (tok/s):':<40}{s.output_throughput:>10.2f}",
        f"{'Total token throughput (tok/s):':<40}{s.total_token_throughput:>10.2f}",
    ]
    if s.request_goodput is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{s.request_goodput:>10.2f}")
    for label, dist in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2EL", s.e2el_ms)):
        for stat, value in dist.items():
            if stat != "std":
                lines.append(f"{f'{stat.capitalize()} {label} (ms):':<40}{value:>10.2f}")
    return "\n".join(lines)
