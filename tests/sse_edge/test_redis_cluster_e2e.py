"""An edge whose keys, rate limits and stream records live on a real three-primary Redis Cluster
(`TOKENBUS_EDGE_REDIS_CLUSTER`): a key's and its tenant's buckets fall on different shards, and
the limits hold as on one server."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.conftest import MODEL
from tokenbus.infra.devstack.processes import free_port
from tokenbus.stores.keys import KeyStore, Limits
from tokenbus.stores.redis_client import redis_client

pytestmark = pytest.mark.stack


async def test_an_edge_on_a_redis_cluster_authenticates_limits_and_serves(stack, redis_cluster):
    name, port = f"edge-cluster-{uuid.uuid4().hex[:4]}", free_port()
    stack.start_edge(name, port, reply_partitions="7", env={"TOKENBUS_EDGE_REDIS_URL": redis_cluster.url,
                                                           "TOKENBUS_EDGE_REDIS_CLUSTER": "true"})
    try:
        client = redis_client(redis_cluster.url, cluster=True)
        store = KeyStore(client, stack.settings.redis_prefix)
        tenant = f"tenant-{uuid.uuid4().hex[:8]}"
        key, _ = await store.create(tenant, "standard", limits=Limits(rpm=3))
        await store.set_tenant_limits(tenant, Limits(rpm=100, tpm=100_000))  # another shard's buckets
        await client.aclose()
        edge = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        for i in range(3):
            reply = await edge.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}])
            assert reply.choices[0].message.content
        with pytest.raises(openai.RateLimitError) as limited:  # before the stream's first byte
            await edge.chat.completions.create(model=MODEL, stream=True, messages=[{"role": "user", "content": "more?"}])
        assert limited.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        async with httpx.AsyncClient() as http:
            ready = await http.get(f"http://127.0.0.1:{port}/readyz")
        assert ready.status_code == 200 and ready.json()["redis"] is True
        with pytest.raises(openai.AuthenticationError):
            await AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key + "x", max_retries=0).models.list()
    finally:
        stack.processes[name].stop()
