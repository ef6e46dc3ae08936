"""What the consumer benchmarks read back from a reply partition (bench/consumer_throughput.py's
``Delivered``): the latencies `python -m bench gpu` reports through the consumer; and the table,
with each consumer run's garbage-collector passes (``CollectorPasses``)."""

import gc

import pytest

from bench.consumer_throughput import CollectorPasses, Delivered


def test_latencies_split_queue_time_from_time_to_first_token_and_inter_token_gaps():
    delivered = Delivered(
        tokens=7, events=6, first_ms=1_010, last_ms=1_130,
        admitted_ms={"a": 1_000, "b": 1_100, "elsewhere": 900},
        event_ms={"a": [1_010, 1_013, 1_017], "b": [1_120, 1_130], "elsewhere": [950]},
    )
    figures = delivered.latencies({"a", "b", "never-admitted"})
    # Queue time counts from the first admission among these requests; TTFT from each one's own.
    assert figures["queue_ms"] == pytest.approx({"median": 50.0, "p99": 99.0})  # 0 and 100 ms
    assert figures["ttft_ms"] == pytest.approx({"median": 15.0, "p99": 19.9})  # 10 and 20 ms
    assert figures["itl_ms"] == pytest.approx({"median": 4.0, "p99": 9.88})  # gaps of 3, 4 and 10 ms


def test_the_table_shows_each_consumer_runs_first_token_after_admission_and_collector_passes():
    """The turnover a consumer adds shows as the tail of first tokens after admission, and its
    garbage collector's passes beside it (the engine alone is not measured so: dashes)."""
    from bench.consumer_throughput import table

    row = {"tokens": 10, "seconds": 1.0, "tokens_per_s": 10.0, "tokens_per_event": 1.0, "cpu_us_per_token": 5.0}
    result = {"engine": "simulated", "requests": 2, "output_tokens": 5, "max_num_seqs": 2, "output_range_ratio": 0,
              "engine_alone": row, "ratio": 1.0,
              "through_consumer": {**row, "ttft_from_admission_ms": {"median": 12.4, "p99": 40.0},
                                   "collector": {"passes": 7, "ms": 20.5, "longest_ms": 8.46}}}
    lines = table(result).splitlines()
    alone = next(line for line in lines if line.startswith("| engine alone"))
    through = next(line for line in lines if line.startswith("| through the consumer"))
    assert alone.endswith("| 5.0 µs | - | - |")
    assert through.endswith("| 5.0 µs | 12 / 40 | 7 / 8.5 |")


def test_collector_passes_are_counted_and_timed_while_entered():
    gc.disable()  # only the passes asked for here
    try:
        with CollectorPasses() as collector:
            for _ in range(3):
                gc.collect()
        gc.collect()  # after: not counted
    finally:
        gc.enable()
    figures = collector.figures()
    assert figures["passes"] == 3
    assert 0 <= figures["longest_ms"] <= figures["ms"]
