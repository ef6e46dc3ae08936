"""Run one edge process with uvicorn, draining open streams on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from starlette.applications import Starlette

from tokenbus.sse_edge.app import create_app
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.topics import cancel_task, tracing
from tokenbus.topics.collector import tune_collector
from tokenbus.topics.event_loops import wants_uvloop

# After the grace, the streams told to resume elsewhere need a moment to write that and close.
CLOSE_MARGIN_S = 5.0
# uvicorn's housekeeping loop turns ten times a second; at rest, an edge has little else to wake for.
TICK_S = 1.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on shutdown stops accepting and waits for open connections; while
    it waits, the edge gives its streams their grace and then tells the rest to resume elsewhere."""

    def __init__(self, config: uvicorn.Config, app: Starlette, grace_s: float) -> None:
        super().__init__(config)
        self._app = app
        self._grace_s = grace_s

    async def main_loop(self) -> None:
        """uvicorn's, turning every ``TICK_S``: the Date header is refreshed on every turn (uvicorn
        does it on every tenth of its own), and a shutdown signal is noticed within one."""
        counter = 0
        while not await self.on_tick(counter):
            await asyncio.sleep(TICK_S)
            counter = (counter + 10) % 864_000

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        edge = getattr(self._app.state, "edge", None)
        drain = asyncio.create_task(edge.drain(self._grace_s)) if edge is not None else None
        try:
            await super().shutdown(sockets)
        finally:
            await cancel_task(drain)
            # uvicorn re-raises SIGTERM once it has shut down, so exit handlers never run: the
            # spans of the last streams go out now.
            await asyncio.to_thread(tracing.flush)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = EdgeSettings()
    tracing.configure("tokenbus-edge", settings.bus.otlp_endpoint)
    app = create_app(settings)
    # Access logs carry no prompt text, but keep them off by default: paths and timings go to /metrics.
    loop = "uvloop" if wants_uvloop(settings.loop) else "asyncio"
    config = uvicorn.Config(app, host=settings.host, port=settings.port, http=settings.http, loop=loop,
                            log_level="warning", access_log=False,
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s + CLOSE_MARGIN_S))
    tune_collector(settings.gc_threshold)
    DrainingServer(config, app, settings.shutdown_grace_s).run()
