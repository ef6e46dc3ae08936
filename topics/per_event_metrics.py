"""Prometheus series a service updates for every token event, kept as plain numbers.

prometheus_client's ``Histogram.observe`` takes two locks and walks the buckets in Python (~1.1 µs
an observation) and ``Counter.inc`` one lock; an edge observes the gap before every token it relays,
a GPU consumer every token it publishes: on the edge that was ~0.8 µs of its ~33 µs an event. These
are updated on the service's event loop, which also serves ``/metrics`` and reads them when scraped,
so they need no lock. Scraped, they read exactly as prometheus_client's own series with the same
name, labels and buckets (less the ``_created`` sample)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class LoopHistogram(Collector):
    """One histogram series (its labels fixed when made); ``observe`` from the event loop only."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry,
                 labels: dict[str, str] | None = None) -> None:
        self._name, self._documentation = name, documentation
        self._labels = labels or {}
        self._bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1  # a bucket counts values <= its bound
        self._sum += value

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        cumulative, buckets = 0, []
        for bound, count in zip((*self._bounds, float("inf")), self._counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric(list(self._labels.values()), buckets, self._sum)
        yield family


class LoopCounter(Collector):
    """One counter series (its labels fixed when made); add to ``value`` from the event loop only."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry,
                 labels: dict[str, str] | None = None) -> None:
        self._name, self._documentation = name, documentation
        self._labels = labels or {}
        self.value = 0
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), self.value)
        yield family
