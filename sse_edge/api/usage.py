"""``GET /v1/usage``: a tenant's own usage and cost, from the billing rollups.

The edge asks the billing processor's ``/usage`` page (the one process that holds the
embedded ClickHouse; in production the same page in front of a ClickHouse server) and
always names the key's tenant itself, so no query parameter can reach another tenant."""

from __future__ import annotations

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.errors import InvalidRequest, Unavailable
from tokenbus.sse_edge.state import EdgeState

FILTERS = ("bucket", "model", "tier", "since", "until")


def usage_unavailable() -> Unavailable:
    return Unavailable("Usage is unavailable right now; retry shortly.", "usage_unavailable", retry_after_s=5)


async def tenant_usage(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    params = {name: request.query_params[name] for name in FILTERS if name in request.query_params}
    params["tenant"] = key.tenant  # last: whatever the query said, this tenant only
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(f"{edge.settings.usage_url}/usage", params=params)
    except httpx.HTTPError:
        raise usage_unavailable() from None
    if response.status_code == 400:
        raise InvalidRequest(response.json().get("error", "bad usage query"), code="invalid_value")
    if response.status_code != 200:
        raise usage_unavailable()
    rows = [{k: v for k, v in row.items() if k != "tenant"} for row in response.json()["rows"]]
    return JSONResponse({"object": "list", "data": rows})
