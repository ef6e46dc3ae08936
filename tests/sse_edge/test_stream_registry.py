"""StreamRegistry's idempotency keys against the real Redis: a client's key, whatever it holds,
binds one request of one tenant."""

import uuid

import pytest
import redis.asyncio as redis

from tokenbus.sse_edge.plumbing.streams import IdempotencyConflict, StreamRegistry


@pytest.fixture
async def registry():
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    prefix = f"test-streams-{uuid.uuid4().hex[:8]}:"
    yield StreamRegistry(client, prefix, ttl_s=60), client, prefix
    async for key in client.scan_iter(f"{prefix}*"):
        await client.delete(key)
    await client.aclose()


async def test_keys_that_spell_each_other_in_a_plain_join_stay_apart(registry):
    streams, client, prefix = registry
    # Joined as `idem:<tenant>:<key>` these two would be one Redis key.
    assert await streams.claim("t1", "k:1", "body-a", "req-a") is None
    assert await streams.claim("t1:k", "1", "body-b", "req-b") is None
    assert await streams.claim("t1", "k:1", "body-a", "req-c") == "req-a"
    with pytest.raises(IdempotencyConflict):
        await streams.claim("t1", "k:1", "body-b", "req-d")


async def test_control_characters_in_a_key_touch_nothing_but_its_own_entry(registry):
    streams, client, prefix = registry
    key = "x\r\nSET evil 1\r\n*\x00"
    assert await streams.claim("t1", key, "body", "req-a") is None
    assert await streams.claim("t1", key, "body", "req-b") == "req-a"
    names = [name async for name in client.scan_iter(f"{prefix}*")]
    assert len(names) == 1 and b"\r" not in names[0] and b"*" not in names[0]
    assert await client.get("evil") is None


async def test_a_key_let_go_of_while_it_is_claimed_is_claimed_again_not_taken_for_another_body(registry):
    """The claim is a set-if-absent, then a read of who holds the key: a request that lets the key
    go in between (it failed, or was not stored and its client went) leaves it free, and the claim
    takes it, rather than reading nothing there as another body's."""
    streams, client, _ = registry
    assert await streams.claim("acme", "retry-me", "body-1", "resp_first") is None
    real_get = client.get

    async def get_after_the_release(name):
        client.get = real_get
        await streams.release("acme", "retry-me", "resp_first")  # the first request lets go just now
        return await real_get(name)

    client.get = get_after_the_release
    assert await streams.claim("acme", "retry-me", "body-1", "resp_retry") is None  # claimed, not a conflict
    with pytest.raises(IdempotencyConflict):
        await streams.claim("acme", "retry-me", "body-2", "resp_other")
    assert await streams.claim("acme", "retry-me", "body-1", "resp_third") == "resp_retry"
