"""The token-bucket limiter against the real Redis (its Lua script; one server, and a
three-primary Redis Cluster, where a request's buckets lie on several shards), and its fallbacks."""

import asyncio
import uuid

import pytest
import redis.asyncio as redis
from redis.crc import key_slot

from tests.waiting import wait_for
from tokenbus.sse_edge.plumbing.ratelimit import (
    Bucket,
    CompletionCharges,
    LocalBuckets,
    RateLimiter,
    RedisUnavailable,
    format_reset,
)
from tokenbus.stores.redis_client import redis_client


@pytest.fixture
def limiter(each_redis):
    client, prefix = each_redis
    return RateLimiter(client, prefix)


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


class CountedCalls:
    """The limiter's completion charges, counted on their way to Redis."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.calls: list[list[Bucket]] = []
        self._charge = limiter.charge_completion
        limiter.charge_completion = self  # type: ignore[method-assign]

    async def __call__(self, buckets: list[Bucket]) -> None:
        self.calls.append(buckets)
        await self._charge(buckets)


async def remaining_tokens(limiter: RateLimiter, name: str) -> float:
    (left,) = await limiter.remaining([Bucket(f"{name}:tpm", "tokens", 600, 0)])
    return left


async def test_completions_ending_together_are_charged_in_one_call_summed_per_bucket(limiter):
    name, other = uuid.uuid4().hex, uuid.uuid4().hex
    counted = CountedCalls(limiter)
    charges = CompletionCharges(limiter, every_s=0.05)
    charges.add([Bucket(f"{name}:tpm", "tokens", 600, 100), Bucket(f"{other}:tpm", "tokens", 600, 7)])
    charges.add([Bucket(f"{name}:tpm", "tokens", 600, 250)])
    charges.add([Bucket(f"{name}:tpm", "tokens", 0, 999), Bucket(f"{other}:tpm", "tokens", 600, 0)])  # nothing due
    assert counted.calls == []  # not yet: the others ending meanwhile go with them
    await wait_for(lambda: counted.calls, 10, "the charges sent")  # (a busy machine delays the call, never splits it)
    assert len(counted.calls) == 1
    assert sorted((b.name, b.cost) for b in counted.calls[0]) == sorted([(f"{name}:tpm", 350), (f"{other}:tpm", 7)])
    assert 600 - 350 <= await remaining_tokens(limiter, name) < 600 - 300  # 10 a second refill meanwhile


async def test_a_charge_made_while_a_call_is_out_goes_in_the_next(limiter):
    name = uuid.uuid4().hex
    counted = CountedCalls(limiter)
    charges = CompletionCharges(limiter, every_s=0.02)
    charges.add([Bucket(f"{name}:tpm", "tokens", 600, 10)])
    while not counted.calls:
        await asyncio.sleep(0)  # the first call is out now
    charges.add([Bucket(f"{name}:tpm", "tokens", 600, 20)])
    await wait_for(lambda: len(counted.calls) > 1, 10, "the second charge sent")
    assert [[b.cost for b in call] for call in counted.calls] == [[10], [20]]


async def test_closing_charges_at_once_what_is_due(limiter):
    name = uuid.uuid4().hex
    charges = CompletionCharges(limiter, every_s=60)
    charges.add([Bucket(f"{name}:tpm", "tokens", 600, 500)])
    await charges.close()
    assert await remaining_tokens(limiter, name) < 600 - 450


async def test_charges_while_redis_is_away_are_kept_locally_or_dropped_as_the_mode_says():
    down = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    local = RateLimiter(down, failure_mode="local")
    charges = CompletionCharges(local, every_s=60)
    charges.add([Bucket("k:tpm", "tokens", 600, 590)])
    await charges.close()
    assert not (await local.admit([Bucket("k:tpm", "tokens", 600, 20)])).allowed  # the debt, kept here
    closed = CompletionCharges(RateLimiter(down, failure_mode="closed"), every_s=60)
    closed.add([Bucket("k:tpm", "tokens", 600, 590)])
    await closed.close()  # nothing raised: a charge is best effort
    await down.aclose()


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


async def test_on_a_cluster_a_bucket_on_another_shard_that_refuses_leaves_the_others_uncharged(redis_cluster):
    """The key's and the tenant's buckets on different hash slots (a level's two share one): the
    script runs once a slot, and one slot's refusal gives back what the others took."""
    client = redis_client(redis_cluster.url, cluster=True)
    limiter = RateLimiter(client, "test-rl-shards:")  # fixed names: their slots are known to differ
    fits, refuses = Bucket("key:k1:rpm", "requests", 100, 1), Bucket("tenant:t1:tpm", "tokens", 10, 50)
    assert key_slot(limiter._key(fits).encode()) != key_slot(limiter._key(refuses).encode())
    assert key_slot(limiter._key(fits).encode()) == key_slot(limiter._key(Bucket("key:k1:tpm", "tokens", 1, 1)).encode())
    await client.delete(limiter._key(fits), limiter._key(refuses))
    try:
        denied = await limiter.admit([fits, refuses])
        assert not denied.allowed and denied.limited_by == refuses and denied.retry_after_s > 0
        assert await limiter.remaining([fits, refuses]) == [100.0, pytest.approx(10.0, abs=0.1)]
        allowed = await limiter.admit([fits, Bucket(refuses.name, "tokens", 10, 5)])
        assert allowed.allowed and allowed.headers["x-ratelimit-remaining-requests"] == "99"
    finally:
        await client.aclose()
