"""Incomplete turns: the GPU consumer dies mid-stream with no one to take over. After the edge's
idle timeout (3 s here) the client gets an error event, the edge closes the turn on the bus,
and the transcript stores the turn as incomplete with exactly the text delivered; the tokens
generated are billed. A new consumer joins, the client continues the turn, and the transcript
stores one completed reply, which is what the uninterrupted generation would have written."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import SLOW_MODEL, SLOW_SETTINGS, own_stack
from tests.expected import expected_output
from tests.sse_edge.test_streams_e2e import CHAT
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack

pytestmark = pytest.mark.stack
SLOW_ENV = {f"TOKENBUS_SIM_{k.upper()}": str(v) for k, v in SLOW_SETTINGS.model_dump().items()}
WORKER = f"gpu-consumer-{SLOW_MODEL}"
MESSAGES = [{"role": "user", "content": "tell me a long story"}]
SEED, MAX_TOKENS = 7, 120


@pytest.fixture
def isolated(stack: EmbeddedStack, tmp_path: Path) -> Iterator[EmbeddedStack]:
    """A stack whose only GPU consumer this test may kill."""
    env = {"TOKENBUS_EDGE_STREAM_IDLE_TIMEOUT_S": "3", "TOKENBUS_PROC_BILLING_BATCH_S": "0.2"}
    with own_stack(stack, tmp_path / "run", [SLOW_MODEL], env, {SLOW_MODEL: SLOW_ENV}) as own:
        yield own


async def assistant_row(http: httpx.AsyncClient, conversation: str, status: str) -> dict:
    for _ in range(150):
        rows = (await http.get(f"/v1/conversations/{conversation}/messages")).json().get("data", [])
        replies = [r for r in rows if r["role"] == "assistant"]
        if replies and replies[-1]["status"] == status:
            assert len(replies) == 1, "one turn, one reply"
            return replies[0]
        await asyncio.sleep(0.1)
    pytest.fail(f"no {status} reply stored: {rows}")


async def test_a_turn_cut_short_is_stored_incomplete_and_its_continuation_completes_it(isolated):
    headers = {"Authorization": f"Bearer {isolated.dev_key}"}
    body = {"model": SLOW_MODEL, "stream": True, "seed": SEED, "max_tokens": MAX_TOKENS, "messages": MESSAGES,
            "metadata": {"conversation_id": "cut-short"}}
    async with httpx.AsyncClient(base_url=isolated.edge_url, timeout=60, headers=headers) as http:
        delivered, errors, request_id = "", [], None
        async with http.stream("POST", CHAT, json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    errors.append(chunk["error"])
                    continue
                request_id = chunk["id"]
                delivered += (chunk["choices"][0]["delta"].get("content") or "") if chunk["choices"] else ""
                if len(delivered.split()) == 10:
                    isolated.processes[WORKER].signal(signal.SIGKILL)  # no other member takes over
        assert errors and errors[0]["code"] == "stream_timeout"
        expected = await expected_output(MESSAGES, seed=SEED, max_tokens=MAX_TOKENS, settings=SLOW_SETTINGS)
        assert expected.text.startswith(delivered) and len(delivered.split()) < MAX_TOKENS

        cut = await assistant_row(http, "cut-short", "incomplete")
        assert cut["content"] == delivered and cut["finish_reason"] == "incomplete"

        isolated.start_worker(f"{WORKER}-2", free_port(), model=SLOW_MODEL, env=SLOW_ENV)
        continued = await http.post(f"{CHAT}/{request_id}/continue", json={"stream": False})
        assert continued.status_code == 200, continued.text
        rest = continued.json()["choices"][0]["message"]["content"]
        assert delivered + rest == expected.text  # as if the consumer had never died
        assert continued.json()["choices"][0]["finish_reason"] == expected.finish_reason

        whole = await assistant_row(http, "cut-short", "completed")
        assert whole["content"] == expected.text and whole["request_id"] == request_id

        again = await http.post(f"{CHAT}/{request_id}/continue")
        assert again.status_code == 409 and again.json()["error"]["code"] == "turn_continued"
        done = await http.post(f"{CHAT}/{continued.json()['id']}/continue")
        assert done.status_code == 409 and done.json()["error"]["code"] == "turn_complete"
        stranger = await isolated.create_key("stranger", "standard")
        hidden = await http.post(f"{CHAT}/{request_id}/continue", headers={"Authorization": f"Bearer {stranger}"})
        assert hidden.status_code == 404

        for _ in range(100):  # billed: what was generated before the cut, and what the continuation added
            rows = (await http.get("/v1/usage")).json()["data"]
            if sum(r["requests"] for r in rows) >= 2:
                break
            await asyncio.sleep(0.2)
        assert sum(r["requests"] for r in rows) == 2
        assert sum(r["completion_tokens"] for r in rows) == expected.completion_tokens
