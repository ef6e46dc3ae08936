"""``POST /v1/chat/completions/{completion_id}/cancel``: stop a generation now (the console's Stop
button). A client that only disconnects is cancelled once ``TOKENBUS_EDGE_DISCONNECT_GRACE_S`` has
passed without a resume; this spares the GPU that wait. Only the tenant that made the request may
cancel it (anyone else is told it does not exist); cancelling a finished turn changes nothing. A
response of several choices is cancelled whole."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.schemas import group_cancel_id
from tokenbus.sse_edge.api.resume import find_stream
from tokenbus.sse_edge.state import EdgeState


async def cancel_completion(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    request_id = request.path_params["completion_id"]
    record = await find_stream(edge, request_id, key.tenant)
    # A response of several choices: each of them, in one record (``{id}-*``).
    await edge.bus.cancel(group_cancel_id(request_id) if record.choices else request_id, "cancelled by the client")
    return JSONResponse({"id": request_id, "object": "chat.completion.cancellation", "cancelled": True})
