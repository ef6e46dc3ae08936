"""Metric definitions of the load generator, on hand-made results (no timing involved)."""

import statistics

import pytest

from tokenbus.infra.loadgen import RequestResult, Slo, arrival_gaps, percentile, summarize
from tokenbus.infra.loadgen.prompts import synthetic_prompts


def result(ttft: float, latency: float, tokens: int, gaps: list[float], ok: bool = True) -> RequestResult:
    return RequestResult(success=ok, prompt_tokens=10, output_tokens=tokens, ttft=ttft, latency=latency, itl=gaps,
                         error="" if ok else "HTTP 500: boom")


def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile([], 50) == 0.0


def test_summary_uses_vllm_definitions():
    results = [
        result(0.100, 0.500, 5, [0.1, 0.1, 0.1, 0.1]),
        result(0.200, 0.200, 1, []),
        result(0.0, 0.0, 0, [], ok=False),
    ]
    s = summarize(results, duration_s=2.0, percentiles=(50.0, 99.0))
    assert (s.completed, s.failed) == (2, 1)
    assert s.errors == {"HTTP 500": 1}
    assert s.total_output_tokens == 6 and s.total_input_tokens == 20
    assert s.request_throughput == 1.0 and s.output_throughput == 3.0 and s.total_token_throughput == 13.0
    assert s.ttft_ms["mean"] == pytest.approx(150.0)
    # TPOT excludes the first token and requests with a single token: (500 - 100) / 4
    assert s.tpot_ms["mean"] == pytest.approx(100.0)
    assert s.itl_ms["median"] == pytest.approx(100.0)
    assert s.e2el_ms["p50"] == pytest.approx(350.0)


def test_goodput_counts_requests_meeting_every_slo():
    # the second has a slow TTFT; the third a TPOT of 200 ms
    results = [result(0.05, 0.3, 3, [0.1, 0.1]), result(0.5, 0.9, 3, [0.1, 0.1]), result(0.05, 0.45, 3, [0.2, 0.2])]
    s = summarize(results, 1.0, slo=Slo.parse(["ttft:100", "tpot:150"]))
    assert s.request_goodput == 1.0
    assert summarize(results, 1.0).request_goodput is None


def test_bad_goodput_spec_is_rejected():
    with pytest.raises(ValueError):
        Slo.parse(["latency:5"])


def test_arrivals_have_the_requested_mean_and_burstiness():
    poisson = arrival_gaps(20000, rate=50, burstiness=1.0, seed=3)
    bursty = arrival_gaps(20000, rate=50, burstiness=0.25, seed=3)
    assert statistics.fmean(poisson) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.fmean(bursty) == pytest.approx(1 / 50, rel=0.05)
    cv2 = lambda xs: statistics.pvariance(xs) / statistics.fmean(xs) ** 2  # noqa: E731
    assert cv2(poisson) == pytest.approx(1.0, rel=0.1)  # gamma: CV^2 = 1 / shape
    assert cv2(bursty) == pytest.approx(4.0, rel=0.15)
    assert arrival_gaps(3, rate=float("inf")) == [0.0, 0.0, 0.0]


def test_synthetic_prompt_lengths_stay_in_range():
    prompts = synthetic_prompts(200, input_len=40, output_len=20, range_ratio=0.5, seed=1)
    assert all(20 <= p.prompt_len <= 60 and len(p.text.split()) == p.prompt_len for p in prompts)
    assert all(10 <= p.output_len <= 30 for p in prompts)
    assert len({p.output_len for p in prompts}) > 5
