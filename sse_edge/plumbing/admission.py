"""Admission: whether a request may enter the bus now, and for which model. In order: the bus
answers; the model's queue for the key's tier has room, or else its fallback model's has
(``TOKENBUS_EDGE_FALLBACK``, unless the key forbids it); a request offering tools is not on a
tier that sheds them at this depth; and every rate limit that applies (per key, per tenant,
per model and tier; requests and tokens per minute) can pay for it. Each refusal is an
``ApiError`` the client can act on (``Retry-After`` on all of them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenbus.sse_edge.errors import RateLimited, Unavailable
from tokenbus.sse_edge.plumbing.auth import Authenticator
from tokenbus.sse_edge.plumbing.broker_watch import BrokerWatch
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.plumbing.queue_depth import QueueDepthMonitor
from tokenbus.sse_edge.plumbing.ratelimit import Bucket, CompletionCharges, RateLimiter, RedisUnavailable
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.stores.keys import ApiKey, Limits

MODEL_HEADER = "x-tokenbus-model"  # the model that serves the request
FALLBACK_HEADER = "x-tokenbus-fallback-from"  # the model asked for, when another serves it


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request let in: the model that serves it, the token buckets with a limit it was charged to
    (its completion tokens are charged to them when it ends; only these are kept, as an open stream
    holds this for its whole life, and none for a key without token limits at any level) and the
    headers for its response (``x-ratelimit-*``, and which model serves it)."""

    model: str
    token_buckets: list[Bucket]
    headers: dict[str, str]


class Admission:
    def __init__(self, watch: BrokerWatch, queues: QueueDepthMonitor, auth: Authenticator, limiter: RateLimiter,
                 settings: EdgeSettings, metrics: EdgeMetrics) -> None:
        self._watch = watch
        self._queues = queues
        self._auth = auth
        self._limiter = limiter
        self._completions = CompletionCharges(limiter)
        self._max_queue_depth = settings.max_queue_depth
        self._fallback = settings.fallback
        self._shed_tools_at = settings.shed_tools_at
        self._metrics = metrics

    async def admit(self, key: ApiKey, model: str, tier: str, prompt_tokens: int, offers_tools: bool = False) -> Admitted:
        """Admit a request of ``key``'s for ``model`` at ``tier`` (its key's, or a lower one it asked for)."""
        self._check_bus()
        served = self._serving_model(key, model, tier)
        if offers_tools:
            self._check_tools(served, tier)
        buckets = await self._buckets(key, served, tier, prompt_tokens)
        headers = {**await self._charge(buckets), MODEL_HEADER: served}
        if served != model:
            headers[FALLBACK_HEADER] = model
        return Admitted(served, [b for b in buckets if b.dimension == "tokens" and b.limit > 0], headers)

    async def admit_call(self, key: ApiKey) -> dict[str, str]:
        """A call that generates nothing (``/v1/moderations``): one request on the key's and its
        tenant's per-minute limits (no model's); the rate-limit headers."""
        levels = await self._levels(key)
        return await self._charge([Bucket(f"{name}:rpm", "requests", limits.rpm, 1) for name, limits in levels.values()])

    def charge_completion(self, token_buckets: list[Bucket], completion_tokens: int) -> None:
        """Charge what a request generated to its token buckets, with the others ending now (best
        effort: Redis may be away)."""
        self._completions.add([Bucket(b.name, b.dimension, b.limit, completion_tokens) for b in token_buckets])

    async def close(self) -> None:
        await self._completions.close()

    def _check_bus(self) -> None:
        if not self._watch.available:
            raise Unavailable("The request bus is unavailable; retry shortly.", "bus_unavailable", retry_after_s=2)

    def _queue_full(self, model: str, tier: str, share: float = 1.0) -> bool:
        limit = self._max_queue_depth.get(tier)
        return limit is not None and self._queues.depth(model, tier) >= limit * share

    def _serving_model(self, key: ApiKey, model: str, tier: str) -> str:
        """``model``, or its fallback while ``model``'s queue for ``tier`` is full."""
        if not self._queue_full(model, tier):
            return model
        fallback = self._fallback.get(model)
        if fallback is not None and key.fallback and key.allows(fallback) and not self._queue_full(fallback, tier):
            self._metrics.fallbacks.labels(model, fallback, tier).inc()
            return fallback
        self._metrics.overloaded.labels(tier).inc()
        raise Unavailable(f"The {tier} queue for `{model}` is full; retry shortly.", "overloaded", retry_after_s=2)

    def _check_tools(self, model: str, tier: str) -> None:
        share = self._shed_tools_at.get(tier)
        if share is not None and self._queue_full(model, tier, share):
            self._metrics.overloaded.labels(tier).inc()
            raise Unavailable(f"`{model}` is under load: the {tier} tier takes no requests with 'tools' now; retry "
                              "shortly, or send the request without them.", "tools_shed_under_load", retry_after_s=2)

    async def quota(self, key: ApiKey) -> dict[str, dict[str, int | None]]:
        """The key's own and its tenant's per-minute limits and what is left of them now (None:
        no limit at that level)."""
        quota: dict[str, dict[str, int | None]] = {}
        for level, (name, limits) in (await self._levels(key)).items():
            buckets = [Bucket(f"{name}:rpm", "requests", limits.rpm, 0), Bucket(f"{name}:tpm", "tokens", limits.tpm, 0)]
            limited = [b for b in buckets if b.limit > 0]
            left = dict(zip([b.name for b in limited], await self._limiter.remaining(limited), strict=True))
            quota[level] = {
                "requests_per_minute": limits.rpm or None, "tokens_per_minute": limits.tpm or None,
                "remaining_requests": math.floor(left[buckets[0].name]) if limits.rpm else None,
                "remaining_tokens": math.floor(left[buckets[1].name]) if limits.tpm else None,
            }
        return quota

    async def _levels(self, key: ApiKey) -> dict[str, tuple[str, Limits]]:
        """The key's own and its tenant's limits, each under the name its buckets take."""
        return {"key": (f"key:{key.key_id}", key.limits),
                "tenant": (f"tenant:{key.tenant}", await self._auth.tenant_limits(key.tenant))}

    async def _buckets(self, key: ApiKey, model: str, tier: str, prompt_tokens: int) -> list[Bucket]:
        route = await self._auth.route_limits(model, tier)
        levels = [*(await self._levels(key)).values(), (f"route:{model}:{tier}", route)]
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
