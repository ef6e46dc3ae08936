"""An edge SIGKILLed with many streams open: every client resumes on another edge with
Last-Event-ID and reads exactly the text an uninterrupted stream would have given."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import httpx
import pytest

from tests.conftest import SLOW_MODEL, SLOW_SETTINGS
from tests.expected import expected_output
from tests.faults.conftest import FAULT_RUNS
from tests.sse_edge.test_streams_e2e import CHAT, content_of, sse_events
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack

pytestmark = pytest.mark.stack
STREAMS = 16


async def read_until_killed(http: httpx.AsyncClient, url: str, body: dict, got: list, started: asyncio.Event) -> None:
    try:
        async with http.stream("POST", url, json=body) as response:
            buffer = ""
            async for chunk in response.aiter_text():
                buffer += chunk
                *complete, buffer = buffer.split("\n\n")
                got += sse_events("\n\n".join(complete))
                if sum(1 for e in got if "id" in e) >= 5:
                    started.set()
    except httpx.HTTPError:
        pass  # the edge died under us


async def resume(http: httpx.AsyncClient, edge_url: str, events: list[dict]) -> list[dict]:
    """The rest of a stream, from the edge at ``edge_url``, after the last event id in ``events``."""
    request_id = json.loads(events[0]["data"])["id"]
    last_id = [e["id"] for e in events if "id" in e][-1]
    response = await http.get(f"{edge_url}{CHAT}/{request_id}/stream", headers={"Last-Event-ID": last_id})
    assert response.status_code == 200
    return sse_events(response.text)


@pytest.mark.parametrize("run", range(FAULT_RUNS))
async def test_every_stream_resumes_identically_after_an_edge_sigkill(stack: EmbeddedStack, api_key, run):
    port = free_port()
    name = f"edge-doomed-{uuid.uuid4().hex[:4]}"
    doomed = stack.start_edge(name, port, reply_partitions="3")
    bodies = [{"model": SLOW_MODEL, "stream": True, "seed": 500 + 100 * run + i, "max_tokens": 40,
               "messages": [{"role": "user", "content": f"story {i}"}]} for i in range(STREAMS)]
    got: list[list[dict]] = [[] for _ in bodies]
    started = [asyncio.Event() for _ in bodies]
    sse = {"Accept": "text/event-stream"}  # an SSE client: each event carries its id
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {api_key}", **sse},
                                 limits=httpx.Limits(max_connections=STREAMS * 2)) as http:
        readers = [asyncio.create_task(read_until_killed(http, f"http://127.0.0.1:{port}{CHAT}", b, g, s))
                   for b, g, s in zip(bodies, got, started)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        doomed.signal(signal.SIGKILL)  # every stream is mid-way
        await asyncio.gather(*readers)

        rests = await asyncio.gather(*(resume(http, stack.edge_url, g) for g in got))
    for body, before, after in zip(bodies, got, rests):
        expected = await expected_output(body["messages"], seed=body["seed"], max_tokens=40, settings=SLOW_SETTINGS)
        assert content_of(before) + content_of(after) == expected.text  # no gap, no repeat
        assert after[-1]["data"] == "[DONE]"
        ids = [e["id"] for e in before + after if "id" in e]
        assert len(ids) == len(set(ids))
