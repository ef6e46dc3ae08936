"""Fault fixtures: services started apart from the session stack (on its broker, with topics
and stores of their own), so killing them disturbs no other test."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import unique_prefix
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack
from tokenbus.topics import TopicCatalog, ensure_topics

# `make faults` repeats each fault this many times; `make test` once.
FAULT_RUNS = int(os.environ.get("TOKENBUS_FAULT_RUNS", "1"))


@pytest.fixture
def side_stack(stack: EmbeddedStack, tmp_path: Path) -> Iterator[EmbeddedStack]:
    """Shares the session's broker and Redis; its own topic prefix, run directory and stores."""
    settings = stack.settings.model_copy(update={
        "run_root": tmp_path / "run", "topic_prefix": unique_prefix(), "processors_port": free_port(),
        "edge_port": free_port(), "worker_port": free_port(),
    })
    side = EmbeddedStack(settings, extra_env={**stack.extra_env, "TOKENBUS_PROC_BILLING_BATCH_S": "0.2",
                                              "TOKENBUS_PROC_RETRY_MAX_DELAY_S": "0.5"})
    side.run_dir.mkdir(parents=True)
    asyncio.run(ensure_topics(side.bootstrap_servers, TopicCatalog(side.bus_settings()).all_topics()))
    try:
        yield side
    finally:
        side.stop()
