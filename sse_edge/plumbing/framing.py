"""Refuse requests whose body can be framed two ways.

A request with both ``Content-Length`` and ``Transfer-Encoding``, with ``Content-Length``
twice, or with a transfer coding other than ``chunked`` may be split into requests
differently by a proxy in front of the edge and by the edge's HTTP server: the bytes one of
them reads as body, the other runs as a request of its own (request smuggling, RFC 9112
§6.3). Such a request is answered ``400`` and its connection closed, so nothing sent after
it on that connection is served.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenbus.sse_edge.errors import InvalidRequest


def framing_problem(headers: list[tuple[bytes, bytes]]) -> str | None:
    lengths = [value for name, value in headers if name == b"content-length"]
    codings = [value.strip().lower() for name, value in headers if name == b"transfer-encoding"]
    if lengths and codings:
        return "both Content-Length and Transfer-Encoding"
    if len(lengths) > 1:
        return "Content-Length more than once"
    if codings and codings != [b"chunked"]:
        return "a Transfer-Encoding other than chunked"
    return None


class RefuseAmbiguousFraming:
    """Pure ASGI, in front of everything else."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        problem = framing_problem(scope["headers"]) if scope["type"] == "http" else None
        if problem is None:
            return await self.app(scope, receive, send)
        error = InvalidRequest(f"The request has {problem}; its body cannot be framed one way only.",
                               code="ambiguous_framing", headers={"Connection": "close"})
        await error.response()(scope, receive, send)
