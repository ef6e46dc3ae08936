"""Acceptance with the official openai package: keys, scoping, rate limits and their headers."""

import openai
import pytest

from tests.conftest import ALIAS, MODEL, SLOW_MODEL
from tokenbus.stores.keys import Limits

MESSAGES = [{"role": "user", "content": "hello"}]


def client_for(edge_url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0, timeout=30)


async def test_a_wrong_key_is_401(edge_url):
    with pytest.raises(openai.AuthenticationError) as exc:
        await client_for(edge_url, "tb-0000-not-a-key").chat.completions.create(model=MODEL, messages=MESSAGES)
    assert exc.value.code == "invalid_api_key"


async def test_a_revoked_key_stops_working(stack, edge_url):
    import asyncio

    import redis.asyncio as redis

    from tokenbus.stores.keys import KeyStore

    key = await stack.create_key("revoker", "standard")
    client = client_for(edge_url, key)
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    connection = redis.Redis.from_url(stack.settings.redis_url)
    await KeyStore(connection, stack.settings.redis_prefix).revoke(key.split("-")[1])
    await connection.aclose()
    await asyncio.sleep(0.6)  # the edge caches key records for 0.5 s in this stack
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)


async def test_models_are_scoped_to_the_key(stack, edge_url):
    key = await stack.create_key("scoped", "standard", models=(MODEL,))
    client = client_for(edge_url, key)
    assert [m.id for m in (await client.models.list()).data] == [MODEL, ALIAS]  # (ALIAS is MODEL's other name)
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):  # as the list leaves it out
        await client.models.retrieve(SLOW_MODEL)
    with pytest.raises(openai.PermissionDeniedError) as exc:
        await client.chat.completions.create(model=SLOW_MODEL, messages=MESSAGES)
    assert exc.value.code == "model_not_allowed"
    slow_only = client_for(edge_url, await stack.create_key("scoped-slow", "standard", models=(SLOW_MODEL,)))
    assert [m.id for m in (await slow_only.models.list()).data] == [SLOW_MODEL]
    with pytest.raises(openai.PermissionDeniedError):  # an alias is its model: a key that may not use it may not
        await slow_only.chat.completions.create(model=ALIAS, messages=MESSAGES)


async def test_over_the_request_limit_is_a_rate_limit_error_with_retry_after(stack, edge_url):
    client = client_for(edge_url, await stack.create_key("limited", "standard", limits=Limits(rpm=2)))
    for _ in range(2):
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as exc:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    headers = exc.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-limit-requests"] == "2"
    assert exc.value.code == "rate_limit_exceeded"


async def test_tenant_limits_bind_every_key_of_the_tenant(stack, edge_url):
    import redis.asyncio as redis

    from tokenbus.stores.keys import KeyStore

    connection = redis.Redis.from_url(stack.settings.redis_url)
    await KeyStore(connection, stack.settings.redis_prefix).set_tenant_limits("team", Limits(rpm=1))
    await connection.aclose()
    first = client_for(edge_url, await stack.create_key("team", "standard"))
    second = client_for(edge_url, await stack.create_key("team", "standard"))
    await first.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        await second.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)


async def test_token_limits_count_the_prompt(stack, edge_url):
    client = client_for(edge_url, await stack.create_key("wordy", "standard", limits=Limits(tpm=50)))
    with pytest.raises(openai.RateLimitError) as exc:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 400}])
    assert exc.value.type == "tokens"


async def test_rate_limit_headers_arrive_on_streams_and_plain_responses(stack, edge_url):
    # 5 a minute: the bucket gives one back every 12 s, so the second request finds one fewer
    # (at 100 a minute, a second request 0.6 s later on a busy machine found as many as the first).
    client = client_for(edge_url, await stack.create_key("headers", "standard", limits=Limits(rpm=5, tpm=100_000)))
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, stream=True)
    async for _ in raw.parse():
        pass
    plain = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES)
    for response in (raw, plain):
        for name in ("limit", "remaining", "reset"):
            assert f"x-ratelimit-{name}-requests" in response.headers
            assert f"x-ratelimit-{name}-tokens" in response.headers
    assert int(plain.headers["x-ratelimit-remaining-requests"]) < int(raw.headers["x-ratelimit-remaining-requests"])
