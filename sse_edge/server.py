"""Run one edge process with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from tokenbus.sse_edge.app import create_app
from tokenbus.sse_edge.settings import EdgeSettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = EdgeSettings()
    # Access logs carry no prompt text, but keep them off by default: paths and timings go to /metrics.
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, http=settings.http, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5)
