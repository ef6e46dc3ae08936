"""The per-token series the worker keeps as plain numbers (topics/per_event_metrics.py) read
exactly as prometheus_client's own counter and histogram would for the same updates."""

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tokenbus.gpu_consumers.metrics import LABELS, LATENCY_BUCKETS, WorkerMetrics


def exposition(registry: CollectorRegistry, *names: str) -> list[str]:
    return sorted(line for line in generate_latest(registry).decode().splitlines()
                  if line.startswith(names) and "_created" not in line)


@given(gaps=st.lists(st.one_of(st.sampled_from(LATENCY_BUCKETS), st.floats(0, 100)), max_size=40),
       tokens=st.lists(st.integers(0, 5), max_size=20))
def test_per_token_series_read_as_prometheus_clients_own(gaps, tokens):
    metrics = WorkerMetrics("m")
    reference = CollectorRegistry()
    itl = Histogram("tokenbus:inter_token_latency_seconds", "Gap between a sequence's token events.", LABELS,
                    buckets=LATENCY_BUCKETS, registry=reference).labels("m")
    generated = Counter("tokenbus:generation_tokens", "Tokens generated and published.", LABELS,
                        registry=reference).labels("m")
    for gap in gaps:
        metrics.token_gap(gap)
        itl.observe(gap)
    for count in tokens:
        metrics.tokens(count)
        generated.inc(count)
    names = ("tokenbus:inter_token_latency_seconds", "tokenbus:generation_tokens")
    assert exposition(metrics.registry, *names) == exposition(reference, *names)
