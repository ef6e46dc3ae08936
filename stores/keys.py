"""API keys and tenants, kept in Redis. A key is shown once at creation; Redis holds only its
SHA-256 (keys are 256 random bits, so a slow password hash buys nothing).

Key format: ``tb-<key_id>-<secret>``. The id finds the record; the hash of the whole key
proves it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import asdict, dataclass, field

from tokenbus.stores.redis_client import RedisClient

KEY_PREFIX = "tb"
# Tenant names become parts of Redis keys, topic records and store rows: with no ':' or
# whitespace in them, no tenant's name can spell another tenant's key.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_tenant_name(tenant: str) -> str:
    if not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"tenant name {tenant!r} must be 1-64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return tenant


@dataclass(frozen=True, slots=True)
class Limits:
    """Per minute; 0 means no limit at that level."""

    rpm: int = 0
    tpm: int = 0


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    tenant: str
    tier: str
    models: tuple[str, ...] = ()  # empty: every model served
    limits: Limits = field(default_factory=Limits)
    key_hash: str = ""
    created_at: int = 0
    revoked: bool = False
    # May another model answer when this one's queue is full (the edge's TOKENBUS_EDGE_FALLBACK)?
    fallback: bool = True
    # A tenant admin key also manages its tenant's keys through the API (/v1/keys).
    admin: bool = False

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def public(self) -> dict[str, object]:
        """What `keys list` shows: never the hash."""
        data = asdict(self)
        data.pop("key_hash")
        return data


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_key_id(key: str) -> str | None:
    parts = key.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1]


class KeyStore:
    def __init__(self, client: RedisClient, prefix: str = "tokenbus:") -> None:
        self._redis = client
        self._prefix = prefix

    def _key(self, key_id: str) -> str:
        return f"{self._prefix}key:{key_id}"

    def _tenant(self, tenant: str) -> str:
        return f"{self._prefix}tenant:{tenant}"

    def _route(self, model: str, tier: str) -> str:
        return f"{self._prefix}route:{model}:{tier}"

    async def create(self, tenant: str, tier: str, models: tuple[str, ...] = (), limits: Limits = Limits(),
                     fallback: bool = True, admin: bool = False) -> tuple[str, ApiKey]:
        """Returns the key (shown once) and its stored record."""
        check_tenant_name(tenant)
        key_id = secrets.token_hex(6)
        key = f"{KEY_PREFIX}-{key_id}-{secrets.token_urlsafe(32)}"
        record = ApiKey(key_id, tenant, tier, tuple(models), limits, hash_key(key), int(time.time()), fallback=fallback,
                        admin=admin)
        await self._redis.hset(self._key(key_id), mapping={
            "tenant": tenant, "tier": tier, "models": ",".join(models), "rpm": limits.rpm, "tpm": limits.tpm,
            "key_hash": record.key_hash, "created_at": record.created_at, "revoked": 0, "fallback": int(fallback),
            "admin": int(admin),
        })
        await self._redis.sadd(f"{self._prefix}keys", key_id)
        return key, record

    async def get(self, key_id: str) -> ApiKey | None:
        raw = await self._redis.hgetall(self._key(key_id))
        if not raw:
            return None
        d = {k.decode(): v.decode() for k, v in raw.items()}
        return ApiKey(
            key_id=key_id, tenant=d["tenant"], tier=d["tier"],
            models=tuple(m for m in d.get("models", "").split(",") if m),
            limits=Limits(int(d.get("rpm", 0)), int(d.get("tpm", 0))),
            key_hash=d["key_hash"], created_at=int(d.get("created_at", 0)), revoked=d.get("revoked") == "1",
            fallback=d.get("fallback", "1") == "1",  # keys made before the setting may fall back
            admin=d.get("admin") == "1",
        )

    async def verify(self, key: str) -> ApiKey | None:
        """The key's record if the key is genuine and not revoked."""
        key_id = parse_key_id(key)
        record = await self.get(key_id) if key_id else None
        if record is None or record.revoked or not hmac.compare_digest(record.key_hash, hash_key(key)):
            return None
        return record

    async def list(self, tenant: str | None = None) -> list[ApiKey]:
        ids = sorted(i.decode() for i in await self._redis.smembers(f"{self._prefix}keys"))
        records = [r for r in [await self.get(i) for i in ids] if r is not None]
        return [r for r in records if tenant is None or r.tenant == tenant]

    async def revoke(self, key_id: str) -> bool:
        if not await self._redis.exists(self._key(key_id)):
            return False
        await self._redis.hset(self._key(key_id), "revoked", "1")
        return True

    async def set_tenant_limits(self, tenant: str, limits: Limits) -> None:
        check_tenant_name(tenant)
        await self._redis.hset(self._tenant(tenant), mapping={"rpm": limits.rpm, "tpm": limits.tpm})

    async def tenant_limits(self, tenant: str) -> Limits:
        return _limits(await self._redis.hgetall(self._tenant(tenant)))

    async def set_route_limits(self, model: str, tier: str, limits: Limits) -> None:
        await self._redis.hset(self._route(model, tier), mapping={"rpm": limits.rpm, "tpm": limits.tpm})

    async def route_limits(self, model: str, tier: str) -> Limits:
        return _limits(await self._redis.hgetall(self._route(model, tier)))


def _limits(raw: dict[bytes, bytes]) -> Limits:
    return Limits(int(raw.get(b"rpm", 0)), int(raw.get(b"tpm", 0)))
