"""Admission: whether a request may enter the bus now. In order: the bus answers, the model's
queue for the key's tier has room, and every rate limit that applies (per key, per tenant,
per model and tier; requests and tokens per minute) can pay for it. Each refusal is an
``ApiError`` the client can act on (``Retry-After`` on all of them)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenbus.sse_edge.errors import RateLimited, Unavailable
from tokenbus.sse_edge.plumbing.auth import Authenticator
from tokenbus.sse_edge.plumbing.broker_watch import BrokerWatch
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.plumbing.queue_depth import QueueDepthMonitor
from tokenbus.sse_edge.plumbing.ratelimit import Bucket, RateLimiter, RedisUnavailable
from tokenbus.stores.keys import ApiKey


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request let in: the buckets it was charged to (its completion tokens are charged to
    them when it ends) and the ``x-ratelimit-*`` headers for its response."""

    buckets: list[Bucket]
    headers: dict[str, str]


class Admission:
    def __init__(self, watch: BrokerWatch, queues: QueueDepthMonitor, auth: Authenticator, limiter: RateLimiter,
                 max_queue_depth: dict[str, int], metrics: EdgeMetrics) -> None:
        self._watch = watch
        self._queues = queues
        self._auth = auth
        self._limiter = limiter
        self._max_queue_depth = max_queue_depth
        self._metrics = metrics

    async def admit(self, key: ApiKey, model: str, prompt_tokens: int) -> Admitted:
        self._check_bus()
        self._check_queue_depth(model, key.tier)
        buckets = await self._buckets(key, model, prompt_tokens)
        return Admitted(buckets, await self._charge(buckets))

    async def charge_completion(self, admitted: Admitted, completion_tokens: int) -> None:
        """Charge what the request generated to its token buckets (best effort: Redis may be away)."""
        tokens = [Bucket(b.name, b.dimension, b.limit, completion_tokens)
                  for b in admitted.buckets if b.dimension == "tokens"]
        try:
            await self._limiter.charge_completion(tokens)
        except RedisUnavailable:
            pass

    def _check_bus(self) -> None:
        if not self._watch.available:
            raise Unavailable("The request bus is unavailable; retry shortly.", "bus_unavailable", retry_after_s=2)

    def _check_queue_depth(self, model: str, tier: str) -> None:
        limit = self._max_queue_depth.get(tier)
        if limit is not None and self._queues.depth(model, tier) >= limit:
            self._metrics.overloaded.labels(tier).inc()
            raise Unavailable(f"The {tier} queue for `{model}` is full; retry shortly.", "overloaded", retry_after_s=2)

    async def _buckets(self, key: ApiKey, model: str, prompt_tokens: int) -> list[Bucket]:
        tenant = await self._auth.tenant_limits(key.tenant)
        route = await self._auth.route_limits(model, key.tier)
        levels = [(f"key:{key.key_id}", key.limits), (f"tenant:{key.tenant}", tenant),
                  (f"route:{model}:{key.tier}", route)]
        buckets = []
        for name, limits in levels:
            buckets.append(Bucket(f"{name}:rpm", "requests", limits.rpm, 1))
            buckets.append(Bucket(f"{name}:tpm", "tokens", limits.tpm, prompt_tokens))
        return buckets

    async def _charge(self, buckets: list[Bucket]) -> dict[str, str]:
        try:
            decision = await self._limiter.admit(buckets)
        except RedisUnavailable:
            raise Unavailable("Rate limiting is unavailable; retry shortly.", "rate_limiter_unavailable") from None
        if decision.allowed:
            return decision.headers or {}
        limited = decision.limited_by
        assert limited is not None
        self._metrics.rate_limited.labels(limited.name.split(":")[0]).inc()
        raise RateLimited(
            f"Rate limit reached for {limited.dimension} ({limited.name.rsplit(':', 1)[0]}): limit {limited.limit} per "
            f"minute. Please try again in {decision.retry_after_s:.1f}s.",
            limited.dimension, retry_after_s=max(1, int(decision.retry_after_s + 0.999)), headers=decision.headers,
        )
