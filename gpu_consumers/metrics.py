"""Prometheus metrics of one GPU consumer, shaped like vLLM's under a `tokenbus:` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenbus.topics.per_event_metrics import LoopCounter, LoopHistogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
LABELS = ["model_name"]
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)


class WorkerMetrics:
    """Each series is bound to the model once: it shows zeros before any traffic, and
    ``labels()`` stays off the per-token path."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.model = model

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=LATENCY_BUCKETS, registry=r).labels(model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(model)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(model)

        self._queue_time = histogram("tokenbus:request_queue_time_seconds", "Request creation to admission.")
        self._ttft = histogram("tokenbus:time_to_first_token_seconds", "Request creation to first token published.")
        self._running = gauge("tokenbus:num_requests_running", "Sequences in the engine.")
        self._waiting = gauge("tokenbus:num_requests_waiting", "Fetched requests waiting for a slot.")
        self._occupancy = gauge("tokenbus:batch_occupancy", "Running sequences / max_num_seqs.")
        self._kv_cache = gauge("tokenbus:kv_cache_usage_perc", "Share of the engine's KV cache in use, 0 to 1.")
        self._prompt_tokens = Histogram("tokenbus:request_prompt_tokens", "Prompt tokens of each request generated.",
                                        LABELS, buckets=TOKEN_COUNT_BUCKETS, registry=r).labels(model)
        # Updated for every token: plain numbers on the event loop (topics/per_event_metrics.py).
        labels = dict(zip(LABELS, (model,), strict=True))
        self._generated = LoopCounter("tokenbus:generation_tokens", "Tokens generated and published.", r, labels)
        self._token_gaps = LoopHistogram("tokenbus:inter_token_latency_seconds", "Gap between a sequence's token "
                                         "events.", LATENCY_BUCKETS, r, labels)
        self._cached = counter("tokenbus:prompt_tokens_cached", "Prompt tokens the engine served from its prefix cache.")
        self._aborted = counter("tokenbus:requests_aborted", "Requests cancelled while waiting or running.")
        self._taken_over = counter("tokenbus:requests_taken_over", "Requests continued from another worker's tokens.")
        self._finished = Counter("tokenbus:request_success", "Requests finished, by finish reason.",
                                 LABELS + ["finished_reason"], registry=r)
        self._finished_by_reason = {reason: self._finished.labels(model, reason) for reason in ("stop", "length")}

    def queued(self, seconds: float) -> None:
        self._queue_time.observe(max(seconds, 0.0))

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(max(seconds, 0.0))

    def token_gap(self, seconds: float) -> None:
        self._token_gaps.observe(max(seconds, 0.0))

    def tokens(self, count: int) -> None:
        self._generated.value += count

    def finished(self, reason: str) -> None:
        series = self._finished_by_reason.get(reason)
        if series is None:
            series = self._finished_by_reason[reason] = self._finished.labels(self.model, reason)
        series.inc()

    def aborted(self) -> None:
        self._aborted.inc()

    def taken_over(self) -> None:
        self._taken_over.inc()

    def prompt(self, tokens: int, cached: int = 0) -> None:
        self._prompt_tokens.observe(tokens)
        self._cached.inc(cached)

    def kv_cache(self, usage: float | None) -> None:
        if usage is not None:
            self._kv_cache.set(usage)

    def occupancy(self, running: int, waiting: int, max_num_seqs: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)
        self._occupancy.set(running / max(max_num_seqs, 1))
