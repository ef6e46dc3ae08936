"""What the consumer benchmarks read back from a reply partition (bench/consumer_throughput.py's
``Delivered``): the latencies `python -m bench gpu` reports through the consumer."""

import pytest

from bench.consumer_throughput import Delivered


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
