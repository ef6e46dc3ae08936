"""An edge stopped with SIGTERM with many streams open: it takes no new connection, gives open
streams TOKENBUS_EDGE_SHUTDOWN_GRACE_S (1 s here) to finish, ends the rest with an
`edge_stopping` error event, and exits; every client resumes on another edge with Last-Event-ID
and reads exactly the text an uninterrupted stream would have given."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid

import httpx
import pytest

from tests.conftest import SLOW_MODEL, SLOW_SETTINGS
from tests.expected import expected_output
from tests.faults.conftest import FAULT_RUNS
from tests.faults.test_edge_sigkill import STREAMS, read_until_killed, resume
from tests.sse_edge.test_streams_e2e import CHAT, content_of
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack

pytestmark = pytest.mark.stack
MAX_TOKENS = 150  # 3 s at the slow model's 50 tokens/s: still running when the grace ends


@pytest.mark.parametrize("run", range(FAULT_RUNS))
async def test_every_stream_resumes_identically_after_an_edge_sigterm(stack: EmbeddedStack, api_key, run):
    port = free_port()
    stopping = stack.start_edge(f"edge-stopping-{uuid.uuid4().hex[:4]}", port, reply_partitions="4",
                                env={"TOKENBUS_EDGE_SHUTDOWN_GRACE_S": "1"})
    bodies = [{"model": SLOW_MODEL, "stream": True, "seed": 900 + 100 * run + i, "max_tokens": MAX_TOKENS,
               "messages": [{"role": "user", "content": f"saga {i}"}]} for i in range(STREAMS)]
    got: list[list[dict]] = [[] for _ in bodies]
    started = [asyncio.Event() for _ in bodies]
    sse = {"Accept": "text/event-stream"}
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {api_key}", **sse},
                                 limits=httpx.Limits(max_connections=STREAMS * 2)) as http:
        readers = [asyncio.create_task(read_until_killed(http, f"http://127.0.0.1:{port}{CHAT}", b, g, s))
                   for b, g, s in zip(bodies, got, started)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        stopping.signal(signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.gather(*readers)
        stopping.popen.wait(timeout=15)
        exited_after = time.monotonic() - signalled

        rests = await asyncio.gather(*(resume(http, stack.edge_url, g) for g in got))
    # uvicorn re-raises SIGTERM once its graceful shutdown is done, so the exit status says why it ended.
    assert stopping.popen.returncode == -signal.SIGTERM and exited_after < 1 + 5
    for body, before, after in zip(bodies, got, rests):
        errors = [json.loads(e["data"])["error"] for e in before if e.get("data", "").startswith('{"error"')]
        assert [e["code"] for e in errors] == ["edge_stopping"], "told to resume elsewhere, once"
        expected = await expected_output(body["messages"], seed=body["seed"], max_tokens=MAX_TOKENS,
                                         settings=SLOW_SETTINGS)
        assert content_of(before) + content_of(after) == expected.text  # no gap, no repeat
        assert after[-1]["data"] == "[DONE]"
