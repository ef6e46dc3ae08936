"""``GET /v1/models``: the models this key may use; ``GET /v1/models/{model}``: one of them.
A model the key may not use is not found, as one that does not exist (the list leaves it out)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.errors import model_not_found
from tokenbus.sse_edge.protocol.completion_bodies import model_body, model_list_body
from tokenbus.sse_edge.state import EdgeState


async def list_models(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    return JSONResponse(model_list_body([m for m in edge.settings.bus.models if key.allows(m)]))


async def retrieve_model(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    model = request.path_params["model"]
    if model not in edge.settings.bus.models or not key.allows(model):
        raise model_not_found(model)
    return JSONResponse(model_body(model))
