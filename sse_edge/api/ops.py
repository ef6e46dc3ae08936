"""The operational endpoints: ``/healthz`` (the process runs), ``/readyz`` (the broker and Redis
answer), ``/metrics`` (Prometheus) and ``/openapi.json``."""

from __future__ import annotations

import asyncio
import contextlib
import os

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.protocol.openapi import openapi_spec
from tokenbus.sse_edge.state import EdgeState


async def healthz(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    return JSONResponse({"status": "ok", "open_streams": edge.bus.router.open_streams, "pid": os.getpid()})


async def readyz(request: Request) -> Response:
    """Ready when the broker and Redis both answer."""
    edge: EdgeState = request.app.state.edge
    checks = {"broker": False, "redis": False}
    with contextlib.suppress(Exception):
        await asyncio.wait_for(edge.bus.producer.client.fetch_all_metadata(), 2)
        checks["broker"] = True
    with contextlib.suppress(Exception):
        checks["redis"] = bool(await asyncio.wait_for(edge.redis.ping(), 1))
    ready = all(checks.values())
    return JSONResponse({"status": "ready" if ready else "not ready", **checks}, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    return Response(generate_latest(edge.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_spec())
