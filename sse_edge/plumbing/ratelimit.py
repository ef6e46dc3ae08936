"""Token-bucket rate limits in Redis, checked and charged atomically across every bucket that
applies to a request (per key, per tenant, per model+tier; requests and tokens per minute); on a
Redis Cluster, atomically per level, the levels' charges given back where one refuses.

A bucket holds up to ``limit`` and refills at ``limit`` per minute. Admission charges one
request and the prompt's estimated tokens, only if every bucket can pay; completion tokens
are charged when the request ends and may take a bucket into debt, which later requests
wait out; those of the requests that end within ``CompletionCharges.EVERY_S`` of each other go
to Redis together. If Redis cannot be reached the limiter either keeps limiting in this process
(``local``, the default) or refuses requests (``closed``); it never stops authenticating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as redis
from redis.crc import key_slot

from tokenbus.stores.redis_client import RedisClient

log = logging.getLogger(__name__)

Dimension = Literal["requests", "tokens"]
BUCKET_TTL_MS = 120_000

# KEYS: the buckets. ARGV: now_ms, charge (1 = only if all can pay, 0 = always), then limit
# and cost for each bucket. Returns {allowed, retry_ms, tokens left per bucket (as strings)}.
TOKEN_BUCKET_LUA = """
local now = tonumber(ARGV[1])
local must_fit = tonumber(ARGV[2]) == 1
local left, allowed, retry_ms = {}, 1, 0
for i = 1, #KEYS do
  local limit, cost = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local tokens, ts = tonumber(state[1]), tonumber(state[2])
  if tokens == nil then tokens, ts = limit, now end
  local rate = limit / 60000.0
  tokens = math.min(limit, tokens + math.max(0, now - ts) * rate)
  left[i] = tokens
  if must_fit and tokens < cost then
    allowed = 0
    retry_ms = math.max(retry_ms, math.ceil((cost - tokens) / rate))
  end
end
for i = 1, #KEYS do
  local cost = tonumber(ARGV[2 + 2 * i])
  if allowed == 1 then left[i] = left[i] - cost end
  redis.call('HSET', KEYS[i], 'tokens', left[i], 'ts', now)
  redis.call('PEXPIRE', KEYS[i], {ttl_ms})
  left[i] = tostring(left[i])
end
return {allowed, retry_ms, left}
""".replace("{ttl_ms}", str(BUCKET_TTL_MS))


@dataclass(frozen=True, slots=True)
class Bucket:
    name: str  # e.g. "key:ab12cd" — unique per limited thing and dimension
    dimension: Dimension
    limit: int  # per minute
    cost: int


@dataclass
class Decision:
    allowed: bool
    retry_after_s: float = 0.0
    headers: dict[str, str] | None = None
    limited_by: Bucket | None = None


def format_reset(seconds: float) -> str:
    """OpenAI's style for x-ratelimit-reset-*: ``20ms``, ``1s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes)}m{secs:.0f}s" if minutes else f"{secs:.3g}s"


def rate_limit_headers(buckets: list[Bucket], left: list[float]) -> dict[str, str]:
    """For each dimension, the tightest bucket's limit, remaining and time until full."""
    headers: dict[str, str] = {}
    for dimension in ("requests", "tokens"):
        pairs = [(b, tokens) for b, tokens in zip(buckets, left) if b.dimension == dimension]
        if not pairs:
            continue
        bucket, tokens = min(pairs, key=lambda p: p[1] / p[0].limit)
        headers[f"x-ratelimit-limit-{dimension}"] = str(bucket.limit)
        headers[f"x-ratelimit-remaining-{dimension}"] = str(max(0, math.floor(tokens)))
        headers[f"x-ratelimit-reset-{dimension}"] = format_reset((bucket.limit - tokens) / (bucket.limit / 60))
    return headers


class LocalBuckets:
    """The same algorithm in this process: the fallback while Redis is unreachable."""

    def __init__(self) -> None:
        self._state: dict[str, tuple[float, float]] = {}

    def charge(self, buckets: list[Bucket], must_fit: bool, now_ms: float) -> tuple[bool, float, list[float]]:
        left, retry_ms = [], 0.0
        for b in buckets:
            tokens, ts = self._state.get(b.name, (b.limit, now_ms))
            rate = b.limit / 60000
            tokens = min(b.limit, tokens + max(0.0, now_ms - ts) * rate)
            left.append(tokens)
            if must_fit and tokens < b.cost:
                retry_ms = max(retry_ms, math.ceil((b.cost - tokens) / rate))
        allowed = retry_ms == 0
        if allowed:
            left = [tokens - b.cost for tokens, b in zip(left, buckets)]
        for b, tokens in zip(buckets, left):
            self._state[b.name] = (tokens, now_ms)
        return allowed, retry_ms, left


class RedisUnavailable(RuntimeError):
    pass


class RateLimiter:
    def __init__(self, client: RedisClient, prefix: str = "tokenbus:", failure_mode: str = "local") -> None:
        self._redis = client
        self._prefix = prefix
        self._failure_mode = failure_mode
        self._script = client.register_script(TOKEN_BUCKET_LUA)  # type: ignore[misc]  # a cluster's too
        self._cluster = isinstance(client, redis.RedisCluster)
        self._local = LocalBuckets()
        self.degraded = False

    async def admit(self, buckets: list[Bucket]) -> Decision:
        buckets = [b for b in buckets if b.limit > 0]
        if not buckets:
            return Decision(True, headers={})
        allowed, retry_ms, left = await self._charge(buckets, must_fit=True)
        headers = rate_limit_headers(buckets, left)
        if allowed:
            return Decision(True, headers=headers)
        limited_by = next(b for b, tokens in zip(buckets, left) if tokens < b.cost)
        return Decision(False, retry_ms / 1000, headers, limited_by)

    async def remaining(self, buckets: list[Bucket]) -> list[float]:
        """What each bucket holds now (negative: a debt being waited out), charging nothing."""
        if not buckets:
            return []
        _, _, left = await self._charge([Bucket(b.name, b.dimension, b.limit, 0) for b in buckets], must_fit=False)
        return left

    async def charge_completion(self, buckets: list[Bucket]) -> None:
        """Charge tokens known only at the end (completion tokens); they may leave a debt."""
        buckets = [b for b in buckets if b.limit > 0 and b.cost > 0]
        if buckets:
            await self._charge(buckets, must_fit=False)

    async def _charge(self, buckets: list[Bucket], must_fit: bool) -> tuple[bool, float, list[float]]:
        now_ms = time.time() * 1000
        try:
            slots = self._by_slot(buckets)
            if len(slots) == 1:
                result = await self._run(buckets, must_fit, now_ms)
            else:
                result = await self._charge_by_slot(buckets, slots, must_fit, now_ms)
            self.degraded = False
            return result
        except (redis.RedisError, OSError) as exc:
            if self._failure_mode == "closed":
                raise RedisUnavailable(str(exc)) from exc
            if not self.degraded:
                log.warning("Redis unreachable (%s): rate limiting in this process only", exc)
            self.degraded = True
            return self._local.charge(buckets, must_fit, now_ms)

    async def _run(self, buckets: list[Bucket], must_fit: bool, now_ms: float) -> tuple[bool, float, list[float]]:
        """The script over ``buckets`` (one hash slot's on a cluster)."""
        args: list[float] = [now_ms, 1 if must_fit else 0]
        for b in buckets:
            args += [b.limit, b.cost]
        allowed, retry_ms, left = await self._script(keys=[self._key(b) for b in buckets], args=args)
        return bool(allowed), float(retry_ms), [float(x) for x in left]

    def _key(self, bucket: Bucket) -> str:
        """``<prefix>rl:{key:ab12}:rpm``: a level's buckets (its requests and its tokens) share a
        hash slot, so that on a Redis Cluster a request's buckets take three calls at most."""
        level, _, dimension = bucket.name.rpartition(":")
        return f"{self._prefix}rl:{{{level}}}:{dimension}" if level else f"{self._prefix}rl:{bucket.name}"

    def _by_slot(self, buckets: list[Bucket]) -> list[list[int]]:
        """The buckets' places grouped by their keys' hash slot: one group but on a cluster."""
        if not self._cluster:
            return [list(range(len(buckets)))]
        slots: dict[int, list[int]] = {}
        for i, b in enumerate(buckets):
            slots.setdefault(key_slot(self._key(b).encode()), []).append(i)
        return list(slots.values())

    async def _charge_by_slot(self, buckets: list[Bucket], slots: list[list[int]], must_fit: bool,
                              now_ms: float) -> tuple[bool, float, list[float]]:
        """On a cluster a script may only touch one slot's keys: a request's buckets (its key's, its
        tenant's, its route's: a slot each, ``_key``) are charged a slot at a time, all at once, and
        where one slot's refuse, what the others took is given back. Meanwhile a concurrent request
        may see those buckets lower than they end up (a refusal it would not have had), as with any
        limiter spread over shards; a request is never let through on a bucket that could not pay."""
        results = await asyncio.gather(*(self._run([buckets[i] for i in places], must_fit, now_ms) for places in slots))
        left = [0.0] * len(buckets)
        for places, (_, _, got) in zip(slots, results):
            for i, tokens in zip(places, got):
                left[i] = tokens
        refused = [retry_ms for allowed, retry_ms, _ in results if not allowed]
        if not refused:
            return True, 0.0, left
        charged = [places for places, (allowed, _, _) in zip(slots, results) if allowed]
        await asyncio.gather(*(self._run([Bucket(b.name, b.dimension, b.limit, -b.cost) for b in (buckets[i] for i in places)],
                                         False, now_ms) for places in charged))
        for places in charged:
            for i in places:
                left[i] += buckets[i].cost  # as they were: nothing of this request was taken
        return False, max(refused), left


class CompletionCharges:
    """Completion tokens charged together: what the requests that end within ``EVERY_S`` of each
    other generated, summed per bucket, in one Redis call. A request's end used to wait for its
    own call (a round trip before the stream's ``[DONE]``, and a third Redis command a turn beside
    admission and the stream record); a bucket now learns of it at most ``EVERY_S`` later, as
    LiteLLM's proxy batches its usage counters. ``close`` charges at once what is still due."""

    EVERY_S = 0.05

    def __init__(self, limiter: RateLimiter, every_s: float = EVERY_S) -> None:
        self._limiter = limiter
        self._every_s = every_s
        self._due: dict[str, Bucket] = {}  # bucket name -> the bucket, its cost summed
        self._charging: asyncio.Task[None] | None = None

    def add(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            if b.limit <= 0 or b.cost <= 0:
                continue
            held = self._due.get(b.name)
            self._due[b.name] = b if held is None else Bucket(b.name, b.dimension, b.limit, held.cost + b.cost)
        if self._due and (self._charging is None or self._charging.done()):
            self._charging = asyncio.create_task(self._charge_while_due(), name="completion-charges")

    async def _charge_while_due(self) -> None:
        while self._due:  # what arrived while a call was out goes in the next
            await asyncio.sleep(self._every_s)
            await self.charge_due()

    async def charge_due(self) -> None:
        due, self._due = list(self._due.values()), {}
        if due:
            with contextlib.suppress(RedisUnavailable):  # best effort, as each charge was: Redis may be away
                await self._limiter.charge_completion(due)

    async def close(self) -> None:
        if self._charging is not None:
            self._charging.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._charging
        await self.charge_due()
