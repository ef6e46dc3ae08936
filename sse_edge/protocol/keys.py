"""The bodies of the key endpoints (``/v1/keys``): what a tenant admin may ask for a new key, and
how a key is shown (never its hash; its secret once, when it is made)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenbus.stores.keys import ApiKey


class CreateKeyRequest(BaseModel):
    """``POST /v1/keys``: a key of the admin key's own tenant. What is left out is the admin key's
    own (tier, models); a new key is never an admin key (those come from `tokenbus keys create`)."""

    model_config = ConfigDict(extra="forbid")

    tier: str | None = Field(None, max_length=64)
    models: list[str] | None = Field(None, max_length=64)
    rpm: int = Field(0, ge=0, le=1_000_000_000, description="requests per minute (0: no limit)")
    tpm: int = Field(0, ge=0, le=1_000_000_000_000, description="tokens per minute (0: no limit)")
    fallback: bool = True


def key_body(key: ApiKey) -> dict[str, Any]:
    return {"id": key.key_id, "object": "api_key", "tenant": key.tenant, "tier": key.tier, "models": list(key.models),
            "rpm": key.limits.rpm, "tpm": key.limits.tpm, "fallback": key.fallback, "admin": key.admin,
            "created_at": key.created_at, "revoked": key.revoked}
