"""The Redis client of the services that keep state there (the edge's keys, rate limits, streams
and history; ``tokenbus keys``): one server (or a replicated primary behind one address), or a
Redis Cluster, whose client finds each key's shard from the nodes it is given.

On a cluster a command's keys must share a hash slot. Every command tokenbus sends names one key,
but for the rate limiter's script, which charges all of a request's buckets at once
(sse_edge/plumbing/ratelimit.py runs it once a slot there)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as redis

RedisClient = redis.Redis | redis.RedisCluster


def redis_client(url: str, cluster: bool = False, **options: Any) -> RedisClient:
    """A client of ``url`` (``redis://``, ``rediss://``; with ``cluster``, any node of the cluster)."""
    client: RedisClient = redis.RedisCluster.from_url(url, **options) if cluster else redis.Redis.from_url(url, **options)
    return client
