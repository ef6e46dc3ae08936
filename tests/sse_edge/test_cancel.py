"""``POST /v1/chat/completions/{id}/cancel`` on the running stack: the generation stops at once
and the open stream ends; another tenant's cancel finds nothing and stops nothing."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tests.conftest import SLOW_MODEL

pytestmark = pytest.mark.stack


async def test_cancel_stops_a_generation_at_once_and_only_for_its_tenant(stack):
    owner = await stack.create_key(f"cancel-{uuid.uuid4().hex[:8]}", "standard")
    stranger = await stack.create_key(f"cancel-{uuid.uuid4().hex[:8]}", "standard")
    body = {"model": SLOW_MODEL, "stream": True, "messages": [{"role": "user", "content": "go on and on"}]}
    chunks, finish = [], None
    async with httpx.AsyncClient(base_url=stack.edge_url, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {owner}"}) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                chunks.append(chunk)
                finish = chunk["choices"][0]["finish_reason"] if chunk.get("choices") else finish
                if len(chunks) == 3:
                    path = f"/v1/chat/completions/{chunk['id']}/cancel"
                    refused = await http.post(path, headers={"Authorization": f"Bearer {stranger}"})
                    assert refused.status_code == 404 and refused.json()["error"]["code"] == "stream_not_found"
                    cancelled = await http.post(path, headers={"Authorization": f"Bearer {owner}"})
                    assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
                    cancelled_at = time.monotonic()
            ended_after = time.monotonic() - cancelled_at
    # The slow model would go on for 300 tokens (6 s); a disconnect would have taken the grace too.
    assert finish is None and len(chunks) < 60, len(chunks)  # no finish: the stream ends with an error event
    assert chunks[-1]["error"]["code"] == "generation_cancelled"
    assert ended_after < 5, ended_after
