"""``GET /v1/models``: the models this key may use."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.protocol.chat import model_list_body
from tokenbus.sse_edge.state import EdgeState


async def list_models(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    return JSONResponse(model_list_body([m for m in edge.settings.bus.models if key.allows(m)]))
