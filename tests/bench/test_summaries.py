"""The soak's and the broker scan's summaries, on made-up samples (the runs themselves are
benchmarks, not tests)."""

from bench import broker_scan, soak


def sample(t_s: float, ttft: float | None, rss: dict[str, float]) -> dict:
    return {"t_s": t_s, "ttft_p50_ms": ttft, "rss_mib": rss}


def test_latency_drift_compares_the_first_and_last_quarter_and_minute_of_windows():
    samples = [sample(i * 10, ttft, {}) for i, ttft in enumerate([None, 10, 12, 11, 50, 60, 70, 80, 90])]
    drift = soak.latency_drift(samples)
    # 10 s windows: a quarter is two of the eight, a minute six
    assert drift == {"first_quarter_ms": 11, "last_quarter_ms": 85, "first_minute_ms": 31, "last_minute_ms": 65}


def test_cpu_drift_compares_each_process_in_the_first_and_last_quarter():
    shares = [{"broker": 0.0}, {"broker": 50.0}, {"broker": 52.0}, {"broker": 70.0}, {"broker": 80.0},
              {"broker": 90.0}, {"broker": 100.0}, {"broker": 101.0}, {"broker": 103.0}]
    samples = [{**sample(i * 10, None, {}), "cpu_pct": cpu} for i, cpu in enumerate(shares)]
    assert soak.cpu_drift(samples) == {"broker": {"first_quarter_pct": 51.0, "last_quarter_pct": 102.0}}


def test_latency_drift_needs_enough_windows():
    assert soak.latency_drift([sample(0, 5, {}), sample(10, 6, {})])["first_quarter_ms"] is None


def test_memory_growth_is_measured_from_the_end_of_warm_up():
    rss = [{"edge": 50}, {"edge": 60}, {"edge": 61}, {"edge": 61}, {"edge": 64}, {"edge": 62}, {"edge": 63}, {"edge": 66}]
    growth = soak.growth([sample(i, None, r) for i, r in enumerate(rss)])
    assert growth["edge"] == {"warm_mib": 61, "end_mib": 66, "max_mib": 66, "change_mib": 5}


def test_broker_scan_table_marks_fetches_that_returned_nothing():
    result = {"give_up_s": 3.0, "rows": [{"batches": 16_000, "wait_5_ms": None, "wait_20_ms": 10.5, "wait_50_ms": 14.1}]}
    assert "| 16,000 | nothing | 10.5 ms | 14.1 ms |" in broker_scan.table(result)
