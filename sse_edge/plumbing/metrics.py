"""Prometheus metrics of one edge process, shaped like vLLM's under a `tokenbus:` prefix."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenbus.topics.per_event_metrics import LoopHistogram

# Seconds. The edge sees whole requests, so the range runs past a minute.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class EdgeMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        # Observed by the relay (the inter-token gap for every event it writes): plain numbers on the
        # edge's event loop (topics/per_event_metrics.py).
        self.ttft = LoopHistogram("tokenbus:edge_time_to_first_token_seconds", "Request received to first content "
                                  "chunk.", LATENCY_BUCKETS, r)
        self.itl = LoopHistogram("tokenbus:edge_inter_token_latency_seconds", "Gap between content chunks sent.",
                                 LATENCY_BUCKETS, r)
        self.e2e = LoopHistogram("tokenbus:e2e_request_latency_seconds", "Request received to last byte.",
                                 LATENCY_BUCKETS, r)
        self.open_streams = Gauge("tokenbus:open_streams", "SSE streams open on this edge.", registry=r)
        self.responses = Counter("tokenbus:http_responses", "Responses by status code.", ["status"], registry=r)
        self.rate_limited = Counter("tokenbus:rate_limited", "Requests refused with 429.", ["limit"], registry=r)
        self.overloaded = Counter("tokenbus:overloaded", "Requests refused with 503 for queue depth.", ["tier"],
                                  registry=r)
        self.queue_depth = Gauge("tokenbus:queue_depth", "Requests waiting or running per model and tier (the GPU "
                                 "consumer group's lag on the request topic).", ["model", "tier"], registry=r)
        self.fallbacks = Counter("tokenbus:fallbacks", "Requests served by a fallback model: its queue was full.",
                                 ["model", "fallback", "tier"], registry=r)
        self.resumed = Counter("tokenbus:streams_resumed", "Streams resumed with Last-Event-ID or an idempotent retry.",
                               registry=r)
        self.cancelled = Counter("tokenbus:disconnect_cancels", "Generations cancelled after a client went away.",
                                 registry=r)
        self.placements = Counter("tokenbus:prefix_routing_decisions", "Requests placed by KV-cache-aware routing, "
                                  "by decision (prefix, expected, balance, miss, unknown).", ["route"], registry=r)
        self.placed_hit_tokens = Counter("tokenbus:prefix_routing_hit_tokens", "Cached prompt tokens the placed "
                                         "requests' consumers held, as the router knew them.", registry=r)
        # The stream processors export the same counter for what they moderate.
        self.decisions = Counter("tokenbus:moderation_decisions", "Moderation decisions.", ["stage", "action"],
                                 registry=r)

    def content_sent(self, started: float, last_sent: float | None) -> float:
        """A stream wrote content (``started``: when its request came; ``last_sent``: when it last
        wrote content, None before the first): its time to first token, or the gap since, observed.
        Returns now, the next ``last_sent``."""
        now = time.perf_counter()
        if last_sent is None:
            self.ttft.observe(now - started)
        else:
            self.itl.observe(now - last_sent)
        return now
