"""``GET /v1/models``: the models this key may use (and their aliases); ``GET /v1/models/{model}``:
one of them. A model the key may not use is not found, as one that does not exist (the list
leaves it out)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.errors import model_not_found
from tokenbus.sse_edge.protocol.completion_bodies import model_body, model_list_body
from tokenbus.sse_edge.state import EdgeState


async def list_models(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    return JSONResponse(model_list_body([m for m in named(edge) if key.allows(edge.settings.served_model(m))]))


async def retrieve_model(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    model = request.path_params["model"]
    if model not in named(edge) or not key.allows(edge.settings.served_model(model)):
        raise model_not_found(model)
    return JSONResponse(model_body(model))


def named(edge: EdgeState) -> list[str]:
    """Every name a request may give a model by: the models served, then their aliases."""
    return [*edge.settings.bus.models, *edge.settings.model_aliases]
