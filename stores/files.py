"""Files, as OpenAI's Files API keeps them: what a tenant uploads (a batch's requests) and what
tokenbus writes for it (a batch's output and errors). Kept in Redis, which every edge shares: a
hash says what the file is, its bytes are a key of their own (read only when asked for), and each
tenant's files are a sorted set by creation time, the listing's order. Every read names the
tenant: another tenant's file is not found, whatever its id.

A file lives ``ttl_s`` (OpenAI keeps a batch's files 30 days); its entry in the tenant's set is
dropped by the first listing that finds the file gone."""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass

from tokenbus.stores.redis_client import RedisClient

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
PURPOSE_BATCH = "batch"
PURPOSE_BATCH_OUTPUT = "batch_output"


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: int  # seconds, as OpenAI's file objects say it
    expires_at: int | None = None


class FileStore:
    def __init__(self, client: RedisClient, prefix: str = "tokenbus:", ttl_s: int = 30 * 86_400) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_s = ttl_s

    def _meta(self, file_id: str) -> str:
        return f"{self._prefix}file:{file_id}"

    def _content(self, file_id: str) -> str:
        return f"{self._prefix}file:{file_id}:content"

    def _listing(self, tenant: str) -> str:
        return f"{self._prefix}files:{tenant}"

    async def create(self, tenant: str, purpose: str, filename: str, content: bytes) -> StoredFile:
        now = int(time.time())
        made = StoredFile(f"file-{secrets.token_hex(12)}", tenant, purpose, filename, len(content), now,
                          now + self._ttl_s)
        # The bytes first: a file that is listed can always be read.
        await self._redis.set(self._content(made.id), content, ex=self._ttl_s)
        await self._redis.hset(self._meta(made.id), mapping={
            "tenant": tenant, "purpose": purpose, "filename": filename, "bytes": made.bytes,
            "created_at": now, "expires_at": made.expires_at or 0})
        await self._redis.expire(self._meta(made.id), self._ttl_s)
        await self._redis.zadd(self._listing(tenant), {made.id: time.time()})  # in order within a second too
        return made

    async def get(self, tenant: str, file_id: str) -> StoredFile | None:
        if not FILE_ID.fullmatch(file_id):
            return None
        raw = await self._redis.hgetall(self._meta(file_id))
        if not raw:
            return None
        d = {k.decode(): v.decode() for k, v in raw.items()}
        if d["tenant"] != tenant:
            return None
        return StoredFile(file_id, tenant, d["purpose"], d["filename"], int(d["bytes"]), int(d["created_at"]),
                          int(d["expires_at"]) or None)

    async def content(self, tenant: str, file_id: str) -> bytes | None:
        if await self.get(tenant, file_id) is None:
            return None
        content: bytes | None = await self._redis.get(self._content(file_id))
        return content

    async def list(self, tenant: str, purpose: str | None = None) -> list[StoredFile]:
        """The tenant's files, newest first."""
        ids = [i.decode() for i in await self._redis.zrevrange(self._listing(tenant), 0, -1)]
        found = []
        for file_id in ids:
            stored = await self.get(tenant, file_id)
            if stored is None:
                await self._redis.zrem(self._listing(tenant), file_id)  # expired
            elif purpose is None or stored.purpose == purpose:
                found.append(stored)
        return found

    async def delete(self, tenant: str, file_id: str) -> bool:
        if await self.get(tenant, file_id) is None:
            return False
        await self._redis.zrem(self._listing(tenant), file_id)
        await self._redis.delete(self._meta(file_id))
        await self._redis.delete(self._content(file_id))
        return True
