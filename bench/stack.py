"""An embedded stack for benchmarks: same code as `tokenbus up`, on free ports, in a temp dir."""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from gpu_consumers.engines import SimulatedEngineSettings
from infra.processes import free_port
from infra.stack import EmbeddedStack, StackSettings

MODEL = "tokenbus-sim"


def sim_env(settings: SimulatedEngineSettings) -> dict[str, str]:
    return {f"TOKENBUS_SIM_{k.upper()}": str(v) for k, v in settings.model_dump().items()}


@contextlib.contextmanager
def bench_stack(sim: SimulatedEngineSettings, extra_env: dict[str, str] | None = None) -> Iterator[EmbeddedStack]:
    with tempfile.TemporaryDirectory(prefix="tokenbus-bench-") as tmp:
        settings = StackSettings(
            run_root=Path(tmp),
            broker_port=free_port(),
            edge_port=free_port(),
            worker_port=free_port(),
            topic_prefix=f"bench{uuid.uuid4().hex[:6]}.",
            models=[MODEL],
        )
        stack = EmbeddedStack(settings, extra_env={**sim_env(sim), **(extra_env or {})})
        try:
            stack.start()
            yield stack
        finally:
            stack.stop()
