"""Transcript reads on the edge: scoped to the key's tenant, paginated, with OpenAI-style errors."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.conftest import MODEL
from tests.stream_processors.helpers import eventually
from tokenbus.infra.devstack.stack import EmbeddedStack

pytestmark = pytest.mark.stack


async def chat(stack: EmbeddedStack, key: str, conversation: str, content: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "metadata": {"conversation_id": conversation}}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{stack.edge_url}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


async def get(stack: EmbeddedStack, key: str, path: str, **params) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.get(f"{stack.edge_url}/v1{path}", params=params,
                                headers={"Authorization": f"Bearer {key}"})


async def test_each_tenant_reads_only_its_own_conversations(stack):
    key_a = await stack.create_key(f"a-{uuid.uuid4().hex[:6]}", "standard")
    key_b = await stack.create_key(f"b-{uuid.uuid4().hex[:6]}", "standard")
    key_c = await stack.create_key(f"c-{uuid.uuid4().hex[:6]}", "standard")
    shared = f"shared-{uuid.uuid4().hex[:6]}"  # both tenants happen to pick the same conversation id
    await chat(stack, key_a, shared, "tenant a's question")
    await chat(stack, key_b, shared, "tenant b's question")

    async def messages_of(key: str):
        response = await get(stack, key, f"/conversations/{shared}/messages")
        return response.json()["data"] if response.status_code == 200 else None

    a = await eventually(lambda: messages_of(key_a))
    b = await eventually(lambda: messages_of(key_b))
    assert [m["content"] for m in a if m["role"] == "user"] == ["tenant a's question"]
    assert [m["content"] for m in b if m["role"] == "user"] == ["tenant b's question"]

    response = await get(stack, key_c, f"/conversations/{shared}/messages")
    assert response.status_code == 404 and response.json()["error"]["code"] == "conversation_not_found"
    listed = (await get(stack, key_c, "/conversations")).json()
    assert listed == {"object": "list", "data": [], "has_more": False, "next_cursor": None}


async def test_conversations_and_messages_page_with_cursors(stack):
    key = await stack.create_key(f"p-{uuid.uuid4().hex[:6]}", "standard")
    conversations = sorted(f"conv-{i}" for i in range(3))
    for conversation in conversations:
        await chat(stack, key, conversation, f"hi from {conversation}")

    async def all_listed():
        listed, after = [], None
        while True:
            params = {"limit": 2, **({"after": after} if after else {})}
            page = (await get(stack, key, "/conversations", **params)).json()
            listed += [c["id"] for c in page["data"]]
            after = page["next_cursor"]
            if not page["has_more"]:
                return listed if listed == conversations else None

    await eventually(all_listed)
    first = (await get(stack, key, "/conversations/conv-0/messages", limit=1)).json()
    assert first["has_more"] and first["data"][0]["role"] == "user"
    rest = (await get(stack, key, "/conversations/conv-0/messages", limit=1, after=first["next_cursor"])).json()
    assert not rest["has_more"] and rest["data"][0]["role"] == "assistant"


@pytest.mark.parametrize("params, param", [({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"),
                                           ({"after": "%%%"}, "after")])
async def test_bad_paging_parameters_are_400s(stack, api_key, params, param):
    response = await get(stack, api_key, "/conversations", **params)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


async def test_transcripts_need_a_key(stack):
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{stack.edge_url}/v1/conversations")
    assert response.status_code == 401


@pytest.mark.parametrize("metadata", [{"conversation_id": "has space"}, {"conversation_id": "x" * 129},
                                      {f"k{i}": "v" for i in range(17)}])
async def test_bad_metadata_is_a_400(stack, api_key, metadata):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "metadata": metadata}
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{stack.edge_url}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "metadata"


async def test_usage_is_the_keys_tenant_only_whatever_the_query_says(stack):
    tenant_a, tenant_b = f"ua-{uuid.uuid4().hex[:6]}", f"ub-{uuid.uuid4().hex[:6]}"
    key_a, key_b = await stack.create_key(tenant_a, "standard"), await stack.create_key(tenant_b, "standard")
    answer_a = await chat(stack, key_a, "usage-a", "count me")
    await chat(stack, key_b, "usage-b", "and me")
    await chat(stack, key_b, "usage-b", "me too")

    async def usage_of(key: str, expected_requests: int, **params):
        response = await get(stack, key, "/usage", bucket="day", **params)
        rows = response.json()["data"] if response.status_code == 200 else []
        return rows if sum(r["requests"] for r in rows) == expected_requests else None

    rows_a = await eventually(lambda: usage_of(key_a, 1))
    assert rows_a[0]["completion_tokens"] == answer_a["usage"]["completion_tokens"]
    assert "tenant" not in rows_a[0]
    assert await eventually(lambda: usage_of(key_a, 1, tenant=tenant_b))  # asking for b still shows a
    assert await eventually(lambda: usage_of(key_b, 2))
    bad = await get(stack, key_a, "/usage", bucket="week")
    assert bad.status_code == 400
