"""Run one GPU consumer process: the worker plus a small HTTP server for /healthz and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenbus.gpu_consumers.engines import load_engine
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.gpu_consumers.worker import GpuWorker
from tokenbus.topics import tracing
from tokenbus.topics.collector import tune_collector
from tokenbus.topics.event_loops import loop_factory

log = logging.getLogger(__name__)


def health_app(worker: GpuWorker) -> Starlette:
    async def healthz(request: Request) -> Response:
        ready = worker.ready.is_set()
        body = {"status": "ok" if ready else "starting", "worker_id": worker.settings.worker_id,
                "model": worker.settings.model, "running": worker.running, "completed": worker.completed, "pid": os.getpid(),
                "partitions": worker.partitions}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(worker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/healthz", healthz), Route("/metrics", metrics)])


async def serve_worker(settings: WorkerSettings) -> None:
    worker = GpuWorker(settings, load_engine(settings.engine, settings.max_num_seqs))
    server = uvicorn.Server(
        uvicorn.Config(health_app(worker), host=settings.host, port=settings.port, log_level="warning", lifespan="off")
    )
    # SIGINT/SIGTERM stop the worker (below), which then stops this server; uvicorn must not take them.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop)
    tune_collector(settings.gc_threshold)  # the engine is loaded
    http = asyncio.create_task(server.serve())
    try:
        await worker.run()
    finally:
        server.should_exit = True
        await http


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("tokenbus.gpu_consumers").setLevel(os.environ.get("TOKENBUS_LOG_LEVEL", "INFO").upper())
    settings = WorkerSettings()
    tracing.configure("tokenbus-gpu-consumer", settings.bus.otlp_endpoint)
    with asyncio.Runner(loop_factory=loop_factory(settings.loop)) as runner:
        runner.run(serve_worker(settings))
