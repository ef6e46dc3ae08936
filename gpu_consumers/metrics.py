"""Prometheus metrics of one GPU consumer, shaped like vLLM's under a `tokenbus:` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)


class WorkerMetrics:
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._queue_time = Histogram("tokenbus:request_queue_time_seconds", "Request creation to admission.", labels,
                                     buckets=LATENCY_BUCKETS, registry=r)
        self._ttft = Histogram("tokenbus:time_to_first_token_seconds", "Request creation to first token published.",
                               labels, buckets=LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("tokenbus:inter_token_latency_seconds", "Gap between a sequence's token events.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self._running = Gauge("tokenbus:num_requests_running", "Sequences in the engine.", labels, registry=r)
        self._waiting = Gauge("tokenbus:num_requests_waiting", "Fetched requests waiting for a slot.", labels, registry=r)
        self._occupancy = Gauge("tokenbus:batch_occupancy", "Running sequences / max_num_seqs.", labels, registry=r)
        self._tokens = Counter("tokenbus:generation_tokens", "Tokens generated and published.", labels, registry=r)
        self._finished = Counter("tokenbus:request_success", "Requests finished, by finish reason.",
                                 labels + ["finished_reason"], registry=r)
        self._aborted = Counter("tokenbus:requests_aborted", "Requests cancelled while waiting or running.", labels,
                                registry=r)
        self._taken_over = Counter("tokenbus:requests_taken_over", "Requests continued from another worker's tokens.",
                                   labels, registry=r)
        self.model = model

    def queued(self, seconds: float) -> None:
        self._queue_time.labels(self.model).observe(max(seconds, 0.0))

    def first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model).observe(max(seconds, 0.0))

    def token_gap(self, seconds: float) -> None:
        self._itl.labels(self.model).observe(max(seconds, 0.0))

    def tokens(self, count: int) -> None:
        self._tokens.labels(self.model).inc(count)

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model, reason).inc()

    def aborted(self) -> None:
        self._aborted.labels(self.model).inc()

    def taken_over(self) -> None:
        self._taken_over.labels(self.model).inc()

    def occupancy(self, running: int, waiting: int, max_num_seqs: int) -> None:
        self._running.labels(self.model).set(running)
        self._waiting.labels(self.model).set(waiting)
        self._occupancy.labels(self.model).set(running / max(max_num_seqs, 1))
