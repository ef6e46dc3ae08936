"""The token-bucket limiter against the real Redis (its Lua script), and its fallbacks."""

import uuid

import pytest
import redis.asyncio as redis

from tokenbus.sse_edge.plumbing.ratelimit import Bucket, LocalBuckets, RateLimiter, RedisUnavailable, format_reset


@pytest.fixture
async def limiter():
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    yield RateLimiter(client, f"test-rl-{uuid.uuid4().hex[:8]}:")
    await client.aclose()


def buckets(rpm: int, tpm: int, tokens: int, name: str = "k") -> list[Bucket]:
    return [Bucket(f"{name}:rpm", "requests", rpm, 1), Bucket(f"{name}:tpm", "tokens", tpm, tokens)]


async def test_requests_per_minute_are_enforced_with_retry_after(limiter):
    name = uuid.uuid4().hex
    decisions = [await limiter.admit(buckets(3, 0, 0, name)) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert decisions[2].headers["x-ratelimit-remaining-requests"] == "0"
    assert decisions[0].headers["x-ratelimit-limit-requests"] == "3"
    denied = decisions[3]
    assert denied.limited_by.dimension == "requests" and 0 < denied.retry_after_s <= 20.5


async def test_a_denied_request_charges_no_bucket(limiter):
    name = uuid.uuid4().hex
    both = [Bucket(f"{name}:a", "requests", 100, 1), Bucket(f"{name}:b", "tokens", 10, 50)]
    assert not (await limiter.admit(both)).allowed
    alone = await limiter.admit([Bucket(f"{name}:a", "requests", 100, 1)])
    assert alone.headers["x-ratelimit-remaining-requests"] == "99"


async def test_completion_tokens_are_charged_at_the_end_and_can_make_debt(limiter):
    name = uuid.uuid4().hex
    assert (await limiter.admit(buckets(0, 600, 100, name))).allowed
    await limiter.charge_completion([Bucket(f"{name}:tpm", "tokens", 600, 550)])
    decision = await limiter.admit(buckets(0, 600, 10, name))
    assert not decision.allowed and decision.limited_by.dimension == "tokens"
    assert decision.retry_after_s > 5  # a debt of ~50 tokens at 10 tokens/s plus the 10 asked for


async def test_unlimited_buckets_are_skipped(limiter):
    decision = await limiter.admit(buckets(0, 0, 10**9))
    assert decision.allowed and decision.headers == {}


async def test_redis_down_local_mode_still_limits_and_closed_mode_refuses():
    down = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    local = RateLimiter(down, failure_mode="local")
    assert [(await local.admit(buckets(2, 0, 0))).allowed for _ in range(3)] == [True, True, False]
    assert local.degraded
    closed = RateLimiter(down, failure_mode="closed")
    with pytest.raises(RedisUnavailable):
        await closed.admit(buckets(2, 0, 0))
    await down.aclose()


def test_local_buckets_refill_over_time():
    local = LocalBuckets()
    b = [Bucket("x", "requests", 60, 1)]
    assert local.charge(b * 1, True, now_ms=0)[0]
    for _ in range(59):
        local.charge(b, True, now_ms=0)
    assert not local.charge(b, True, now_ms=0)[0]
    assert local.charge(b, True, now_ms=1000)[0]  # 60/min refills one a second


def test_reset_is_formatted_like_openai():
    assert format_reset(0.02) == "20ms" and format_reset(1) == "1s" and format_reset(360) == "6m0s"
