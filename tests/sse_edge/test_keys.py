"""API keys against the real Redis (one server, and a three-primary Redis Cluster): stored hashed,
verified, revoked; auth when Redis is down."""


import pytest
import redis.asyncio as redis

from tokenbus.sse_edge.errors import ApiError
from tokenbus.sse_edge.plumbing.auth import Authenticator
from tokenbus.stores.keys import KeyStore, Limits, hash_key, parse_key_id

UNREACHABLE = "redis://127.0.0.1:1/0"


@pytest.fixture
def store(each_redis):
    client, prefix = each_redis
    return KeyStore(client, prefix), client, prefix


async def test_keys_are_stored_only_as_hashes(store):
    keys, client, prefix = store
    key, record = await keys.create("acme", "interactive", ("m1",), Limits(10, 1000))
    assert parse_key_id(key) == record.key_id and record.key_hash == hash_key(key)
    stored = b""
    async for name in client.scan_iter(f"{prefix}*"):
        if await client.type(name) == b"hash":
            stored += b"".join((await client.hgetall(name)).values())
    secret = key.split("-", 2)[2]  # the secret is URL-safe base64 and may itself hold a "-"
    assert key.encode() not in stored and secret.encode() not in stored
    assert "key_hash" not in record.public()


async def test_verify_accepts_only_the_real_key_until_revoked(store):
    keys, _, _ = store
    key, record = await keys.create("acme", "standard")
    assert (await keys.verify(key)).tenant == "acme"
    assert await keys.verify(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert await keys.verify("tb-nope-secret") is None and await keys.verify("not-a-key") is None
    assert await keys.revoke(record.key_id)
    assert await keys.verify(key) is None
    assert not await keys.revoke("missing")
    assert [r.key_id for r in await keys.list("acme")] == [record.key_id]


async def test_a_key_may_forbid_fallback_and_older_keys_allow_it(store):
    keys, client, prefix = store
    _, strict = await keys.create("acme", "standard", fallback=False)
    _, lenient = await keys.create("acme", "standard")
    assert (await keys.get(strict.key_id)).fallback is False and (await keys.get(lenient.key_id)).fallback is True
    await client.hdel(f"{prefix}key:{lenient.key_id}", "fallback")  # a key made before the setting existed
    assert (await keys.get(lenient.key_id)).fallback is True


async def test_limits_per_tenant_and_route(store):
    keys, _, _ = store
    await keys.set_tenant_limits("acme", Limits(5, 50))
    await keys.set_route_limits("m", "batch", Limits(7, 70))
    assert await keys.tenant_limits("acme") == Limits(5, 50)
    assert await keys.route_limits("m", "batch") == Limits(7, 70)
    assert await keys.tenant_limits("other") == Limits()


async def test_auth_errors_are_401_in_openai_format(store):
    keys, _, _ = store
    auth = Authenticator(keys)
    for header, code in [(None, "missing_api_key"), ("Basic abc", "missing_api_key"),
                         ("Bearer tb-x-y", "invalid_api_key")]:
        with pytest.raises(ApiError) as exc:
            await auth.authenticate(header)
        assert (exc.value.status, exc.value.code) == (401, code)
        assert "tb-x-y" not in exc.value.message  # keys are never echoed whole


async def test_without_redis_known_keys_work_and_unknown_keys_get_503(store):
    keys, _, prefix = store
    key, _ = await keys.create("acme", "standard")
    auth = Authenticator(keys, cache_ttl_s=0.0)
    assert (await auth.authenticate(f"Bearer {key}")).tenant == "acme"
    down = redis.Redis.from_url(UNREACHABLE, socket_connect_timeout=0.2)
    keys._redis = down  # the same store, its Redis gone
    assert (await auth.authenticate(f"Bearer {key}")).tenant == "acme"  # verified before: still served
    with pytest.raises(ApiError) as exc:
        await auth.authenticate("Bearer tb-abc-neverseen")
    assert exc.value.status == 503  # never served unauthenticated
    await down.aclose()


@pytest.mark.parametrize("tenant", ["", "a:b", "acme idem", "-lead", "x" * 65, "new\nline", "ü"])
async def test_tenant_names_that_could_spell_another_key_are_refused(store, tenant):
    keys, client, prefix = store
    with pytest.raises(ValueError, match="tenant name"):
        await keys.create(tenant, "standard")
    with pytest.raises(ValueError, match="tenant name"):
        await keys.set_tenant_limits(tenant, Limits(1, 1))
    assert [name async for name in client.scan_iter(f"{prefix}*")] == []
