"""The per-event series read, when scraped, exactly as prometheus_client's own counter and
histogram read for the same updates, with labels and without."""

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tokenbus.topics.per_event_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.001, 0.01, 0.1, 1, 2.5, 10)


def exposition(registry: CollectorRegistry) -> list[str]:
    return sorted(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)


@given(values=st.lists(st.one_of(st.sampled_from(BUCKETS), st.floats(0, 100), st.floats(-1, 0)), max_size=40),
       labelled=st.booleans())
def test_histogram_reads_as_prometheus_clients_own(values, labelled):
    ours, reference = CollectorRegistry(), CollectorRegistry()
    labels = {"model_name": "m", "tier": "batch"} if labelled else {}
    histogram = LoopHistogram("tokenbus:gap_seconds", "A gap.", BUCKETS, ours, labels)
    theirs = Histogram("tokenbus:gap_seconds", "A gap.", list(labels), buckets=BUCKETS, registry=reference)
    theirs = theirs.labels(*labels.values()) if labels else theirs
    for value in values:
        histogram.observe(value)
        theirs.observe(value)
    assert exposition(ours) == exposition(reference)


@given(increments=st.lists(st.integers(0, 1000), max_size=20), labelled=st.booleans())
def test_counter_reads_as_prometheus_clients_own(increments, labelled):
    ours, reference = CollectorRegistry(), CollectorRegistry()
    labels = {"model_name": "m"} if labelled else {}
    counter = LoopCounter("tokenbus:generation_tokens", "Tokens.", ours, labels)
    theirs = Counter("tokenbus:generation_tokens", "Tokens.", list(labels), registry=reference)
    theirs = theirs.labels(*labels.values()) if labels else theirs
    for increment in increments:
        counter.value += increment
        theirs.inc(increment)
    assert exposition(ours) == exposition(reference)
