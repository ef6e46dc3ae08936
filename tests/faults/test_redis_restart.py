"""Redis goes away and comes back under an edge: the documented policy holds (keys already
verified keep working from the edge's cache, rate limits fall back to per-process buckets,
a key never seen gets 503), nothing crashes, and no request without a valid key is served."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid

import httpx
import pytest
import redis.asyncio as redis

from tests.conftest import MODEL
from tests.faults.conftest import FAULT_RUNS
from tests.stream_processors.helpers import eventually
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.redis_server import redis_answers, redis_server_argv
from tokenbus.infra.devstack.stack import EmbeddedStack
from tokenbus.stores.keys import KeyStore

pytestmark = pytest.mark.stack
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


def start_redis(url: str, data_dir) -> subprocess.Popen:
    argv = redis_server_argv(url)
    argv[argv.index("--appendonly") + 1] = "yes"  # a restart keeps the keys, as a production Redis would
    process = subprocess.Popen([*argv, "--dir", str(data_dir), "--appendfsync", "always"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        if redis_answers(url):
            return process
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


async def post(url: str, key: str) -> int:
    async with httpx.AsyncClient(timeout=30) as client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = await client.post(f"{url}/v1/chat/completions", json=BODY, headers=headers)
    return response.status_code


@pytest.mark.parametrize("run", range(FAULT_RUNS))
async def test_redis_restart_keeps_the_policy_and_serves_no_unauthenticated_request(stack: EmbeddedStack, tmp_path, run):
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    server = start_redis(redis_url, tmp_path)
    name, port = f"edge-redis-{uuid.uuid4().hex[:4]}", free_port()
    try:
        client = redis.Redis.from_url(redis_url)
        store = KeyStore(client, "fault:")
        used, _ = await store.create("redis-tenant", "standard")
        unused, _ = await store.create("redis-tenant", "standard")
        await client.aclose()
        stack.start_edge(name, port, reply_partitions="6", env={
            "TOKENBUS_EDGE_REDIS_URL": redis_url, "TOKENBUS_EDGE_REDIS_PREFIX": "fault:"})
        edge = f"http://127.0.0.1:{port}"
        assert await post(edge, used) == 200
        assert await post(edge, "tb-forged-key-000000000000") == 401

        server.send_signal(signal.SIGKILL)
        server.wait()
        statuses = {"used": [], "unused": [], "forged": [], "none": []}
        for _ in range(5):
            statuses["used"].append(await post(edge, used))
            statuses["unused"].append(await post(edge, unused))
            statuses["forged"].append(await post(edge, f"tb-forged-{uuid.uuid4().hex}"))
            statuses["none"].append(await post(edge, ""))
        assert set(statuses["used"]) == {200}  # verified before: served from the edge's cache
        assert set(statuses["unused"]) == {503}  # never verified: cannot be checked, so refused
        assert set(statuses["forged"]) == {503}
        assert set(statuses["none"]) == {401}
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{edge}/readyz")).status_code == 503
        assert stack.processes[name].alive()

        server = start_redis(redis_url, tmp_path)  # back, with its data
        await eventually(lambda: served(edge, unused), timeout=20)
        assert await post(edge, "tb-forged-key-000000000001") == 401
    finally:
        if name in stack.processes:
            stack.processes[name].stop()
        server.kill()
        server.wait()


async def served(edge: str, key: str) -> bool:
    return await post(edge, key) == 200
