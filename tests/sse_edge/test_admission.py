"""Admission against the real Redis (keys, limits, the limiter's script); the broker watch and the
queue depths, which need a running bus, are stand-ins that say the bus is up and the queues empty."""

import uuid
from types import SimpleNamespace

import pytest
import redis.asyncio as redis

from tokenbus.sse_edge.errors import Unavailable
from tokenbus.sse_edge.plumbing.admission import Admission
from tokenbus.sse_edge.plumbing.auth import Authenticator
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.plumbing.ratelimit import RateLimiter
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.stores.keys import ApiKey, KeyStore, Limits


@pytest.fixture
async def admission():
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    prefix = f"test-adm-{uuid.uuid4().hex[:8]}:"
    store = KeyStore(client, prefix)
    admission = Admission(SimpleNamespace(available=True), SimpleNamespace(depth=lambda model, tier: 0),
                          Authenticator(store, 1.0), RateLimiter(client, prefix), EdgeSettings(), EdgeMetrics())
    yield admission, store
    await admission.close()
    await client.aclose()


async def test_a_turn_keeps_only_the_token_buckets_that_have_a_limit(admission):
    """What an open stream holds to charge its completion tokens: the limited token buckets of its
    key, tenant and route, and nothing at all where none is limited (charging an unlimited bucket
    does nothing)."""
    admission, store = admission
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    unlimited = ApiKey("k-open", f"{tenant}-open", "standard")
    assert (await admission.admit(unlimited, "m", "standard", prompt_tokens=10)).token_buckets == []

    await store.set_tenant_limits(tenant, Limits(rpm=0, tpm=50_000))
    limited = ApiKey("k-tpm", tenant, "standard", limits=Limits(rpm=100, tpm=1_000))
    admitted = await admission.admit(limited, "m", "standard", prompt_tokens=10)
    assert [(b.name, b.limit) for b in admitted.token_buckets] == [("key:k-tpm:tpm", 1_000),
                                                                  (f"tenant:{tenant}:tpm", 50_000)]
    assert admitted.headers["x-ratelimit-limit-tokens"] == "1000"


async def test_a_request_is_limited_and_queued_as_the_tier_it_runs_at(admission):
    """A request that asked for a lower tier than its key's (``service_tier: flex``) is charged to
    that tier's route limits, and refused when that tier's queue is full, not its key's."""
    admission, store = admission
    model = f"m-{uuid.uuid4().hex[:6]}"
    await store.set_route_limits(model, "batch", Limits(rpm=7, tpm=0))
    key = ApiKey("k-std", f"t-{uuid.uuid4().hex[:6]}", "standard")
    assert "x-ratelimit-limit-requests" not in (await admission.admit(key, model, "standard", 10)).headers
    assert (await admission.admit(key, model, "batch", 10)).headers["x-ratelimit-limit-requests"] == "7"
    admission._queues = SimpleNamespace(depth=lambda model_, tier: 10**9 if tier == "batch" else 0)
    await admission.admit(key, model, "standard", 10)
    with pytest.raises(Unavailable) as refused:
        await admission.admit(key, model, "batch", 10)
    assert refused.value.code == "overloaded" and "batch queue" in str(refused.value)
