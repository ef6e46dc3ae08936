"""Bearer-key authentication with a short cache.

Records are cached for ``cache_ttl_s`` (a revoked key stops working within that time).
While Redis is unreachable, a key verified before keeps working from the cache; a key
never seen gets 503: nothing is ever served unauthenticated.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as redis

from tokenbus.sse_edge.errors import Unauthorized, Unavailable
from tokenbus.stores.keys import ApiKey, KeyStore, Limits, hash_key

T = TypeVar("T")


def redacted(key: str) -> str:
    return f"{key[:6]}...{key[-4:]}" if len(key) > 12 else "***"


class _TtlCache:
    def __init__(self, ttl_s: float) -> None:
        self._ttl = ttl_s
        self._items: dict[object, tuple[float, object]] = {}

    async def get(self, key: object, load: Callable[[], Awaitable[T]]) -> T:
        """Fresh from cache, else loaded; on a Redis failure, stale from cache, else the failure."""
        now = time.monotonic()
        cached = self._items.get(key)
        if cached and cached[0] > now:
            return cached[1]  # type: ignore[return-value]
        try:
            value = await load()
        except (redis.RedisError, OSError):
            if cached:
                return cached[1]  # type: ignore[return-value]
            raise
        self._items[key] = (now + self._ttl, value)
        return value

    def drop(self, key: object) -> None:
        self._items.pop(key, None)


class Authenticator:
    def __init__(self, store: KeyStore, cache_ttl_s: float = 5.0) -> None:
        self._store = store
        self._keys = _TtlCache(cache_ttl_s)
        self._limits = _TtlCache(cache_ttl_s)

    async def authenticate(self, authorization: str | None) -> ApiKey:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.", code="missing_api_key")
        key = key.strip()
        try:
            record = await self._keys.get(hash_key(key), lambda: self._store.verify(key))
        except (redis.RedisError, OSError):
            raise Unavailable("Authentication is unavailable; retry shortly.", "auth_unavailable") from None
        if record is None:
            raise Unauthorized(f"Incorrect API key provided: {redacted(key)}.", code="invalid_api_key")
        return record

    def forget(self, revoked: ApiKey) -> None:
        """A key revoked here is refused here at once (other edges refuse it within the cache's TTL)."""
        self._keys.drop(revoked.key_hash)

    async def tenant_limits(self, tenant: str) -> Limits:
        return await self._cached_limits(("tenant", tenant), lambda: self._store.tenant_limits(tenant))

    async def route_limits(self, model: str, tier: str) -> Limits:
        return await self._cached_limits(("route", model, tier), lambda: self._store.route_limits(model, tier))

    async def _cached_limits(self, key: object, load: Callable[[], Awaitable[Limits]]) -> Limits:
        try:
            return await self._limits.get(key, load)
        except (redis.RedisError, OSError):
            return Limits()  # unknown while Redis is down: the key's own limits still apply
