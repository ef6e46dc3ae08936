"""A tenant's API keys: ``GET /v1/keys/self`` (any key: itself, its limits and what is left of them
this minute), and for a tenant admin key ``GET /v1/keys``, ``POST /v1/keys`` (the new key's secret
is in that answer only) and ``DELETE /v1/keys/{key_id}``. The tenant always comes from the
calling key: another tenant's key is not found, whatever its id."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.errors import NotFound, PermissionDenied, Unavailable
from tokenbus.sse_edge.plumbing.ratelimit import RedisUnavailable
from tokenbus.sse_edge.protocol.keys import CreateKeyRequest, key_body
from tokenbus.sse_edge.protocol.validation import json_object, parse_body, read_body
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.keys import ApiKey, Limits

KEY_ID = re.compile(r"[0-9a-f]{12}")  # as KeyStore.create makes them


async def own_key(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    try:
        quota = await edge.admission.quota(key)
    except RedisUnavailable:
        raise Unavailable("Quotas are unavailable right now; retry shortly.", "quota_unavailable") from None
    return JSONResponse({**key_body(key), "quota": quota})


async def list_keys(request: Request) -> Response:
    edge, admin = await admin_key(request)
    keys = sorted(await edge.keys.list(admin.tenant), key=lambda k: (k.created_at, k.key_id), reverse=True)
    return JSONResponse({"object": "list", "data": [key_body(k) for k in keys]})


async def create_key(request: Request) -> Response:
    edge, admin = await admin_key(request)
    raw = await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s)
    wanted = parse_body(json_object(raw, empty_ok=True), CreateKeyRequest)
    tier = wanted.tier or admin.tier
    tiers = edge.settings.bus.tiers  # highest priority first
    if tier not in tiers:
        raise NotFound(f"There is no tier `{tier}`.", param="tier", code="tier_not_found")
    if tiers.index(tier) < tiers.index(admin.tier):
        raise PermissionDenied(f"A `{admin.tier}` admin key may not make a `{tier}` key.", param="tier",
                               code="tier_not_allowed")
    models = tuple(wanted.models) if wanted.models is not None else admin.models
    for model in models:
        if model not in edge.settings.bus.models:
            raise NotFound(f"The model `{model}` does not exist.", param="models", code="model_not_found")
        if not admin.allows(model):
            raise PermissionDenied(f"This admin key may not use the model `{model}`, so it may not give it.",
                                   param="models", code="model_not_allowed")
    secret, made = await edge.keys.create(admin.tenant, tier, models, Limits(wanted.rpm, wanted.tpm), wanted.fallback)
    return JSONResponse({**key_body(made), "key": secret}, status_code=201)


async def revoke_key(request: Request) -> Response:
    edge, admin = await admin_key(request)
    key_id = request.path_params["key_id"]
    key = await edge.keys.get(key_id) if KEY_ID.fullmatch(key_id) else None
    if key is None or key.tenant != admin.tenant:
        raise NotFound(f"No key '{key_id}'.", param="key_id", code="key_not_found")
    await edge.keys.revoke(key_id)
    edge.auth.forget(key)
    return JSONResponse({"id": key_id, "object": "api_key", "revoked": True})


async def admin_key(request: Request) -> tuple[EdgeState, ApiKey]:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    if not key.admin:
        raise PermissionDenied("Managing keys needs a tenant admin key (`tokenbus keys create --admin`).",
                               code="admin_key_required")
    return edge, key
