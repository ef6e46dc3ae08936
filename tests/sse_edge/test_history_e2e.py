"""Acceptance: server-side history through the real embedded stack. A conversation's stored turns
(transcripts processor -> SQLite) are loaded by the edge, cached in the real Redis, fitted into
the model's context window (300 tokens for SLOW_MODEL on the test stack) and published with the
request; the request records on the bus say what the model saw."""

import asyncio
import uuid

import httpx
import openai
import pytest
import redis.asyncio as redis

from tests.conftest import SLOW_MODEL
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, estimate_prompt_tokens
from tokenbus.sse_edge.plumbing.history import ConversationHistory
from tokenbus.stores.transcripts.sqlite import SqliteTranscriptStore
from tokenbus.topics import TopicCatalog, make_consumer, topic_partitions

WINDOW = 300  # TOKENBUS_EDGE_CONTEXT_WINDOWS on the test stack
MAX_TOKENS = 6
SYSTEM = {"role": "system", "content": "You are terse."}


def tokens(messages) -> int:
    return estimate_prompt_tokens(m["content"] for m in messages)


def expected_prompt(turns: list[list[dict]], new: list[dict]) -> list[dict]:
    """The oracle: the newest whole turns that fit in the window, less max_tokens and the new messages."""
    budget = WINDOW - MAX_TOKENS - tokens(new)
    chosen = []
    for turn in reversed(turns):
        if tokens(turn) > budget:
            break
        chosen.insert(0, turn)
        budget -= tokens(turn)
    return [new[0], *(m for turn in chosen for m in turn), *new[1:]]


async def requests_on_the_bus(stack, request_ids: set[str], model: str = SLOW_MODEL) -> dict[str, ChatRequest]:
    bus = stack.bus_settings()
    topic = TopicCatalog(bus).requests(model, "standard")
    codec, found = AvroCodec(), {}
    consumer = make_consumer(bus)
    await consumer.start()
    try:
        consumer.assign(await topic_partitions(consumer, topic))
        await consumer.seek_to_beginning()
        for _ in range(100):
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    request = codec.decode(record.value, ChatRequest)
                    if request.request_id in request_ids:
                        found[request.request_id] = request
            if len(found) == len(request_ids):
                break
    finally:
        await consumer.stop()
    return found


def as_dicts(messages: list[ChatMessage]) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in messages]


@pytest.fixture
async def tenant_key(stack):
    tenant = f"hist-{uuid.uuid4().hex[:8]}"
    return tenant, await stack.create_key(tenant, "standard")


async def test_thirty_turns_each_hold_exactly_the_newest_turns_that_fit(stack, edge_url, tenant_key):
    tenant, key = tenant_key
    client = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0, timeout=60)
    cache = redis.Redis.from_url(stack.settings.redis_url)
    cache_key = f"{stack.settings.redis_prefix}history:{tenant}:talk-1"
    turns, sent = [], {}
    try:
        for i in range(30):
            user = {"role": "user", "content": f"turn {i}: " + "word " * (3 + i % 7)}
            metadata = {"conversation_id": "talk-1"} | ({"history": "server"} if i else {})
            if i == 15:  # the cache goes: this turn's history is rebuilt from the transcript store
                assert await cache.delete(cache_key) == 1
            response = await client.chat.completions.create(
                model=SLOW_MODEL, messages=[SYSTEM, user], max_tokens=MAX_TOKENS, seed=i, metadata=metadata)
            if i == 15:
                assert await cache.exists(cache_key)  # and is written back
            sent[response.id] = expected_prompt(turns, [SYSTEM, user]) if i else [SYSTEM, user]
            turns.append([user, {"role": "assistant", "content": response.choices[0].message.content}])
    finally:
        await cache.aclose()

    on_bus = await requests_on_the_bus(stack, set(sent))
    assert len(on_bus) == 30
    for request_id, expected in sent.items():
        assert as_dicts(on_bus[request_id].messages) == expected, f"request {request_id}"
    history_turns = [(len(m) - 2) // 2 for m in sent.values()]
    assert history_turns[:6] == [0, 1, 2, 3, 4, 5]  # early on, every earlier turn fits
    assert history_turns[-1] < 29 and max(history_turns) < 29  # later, the oldest ones are dropped


async def test_another_tenants_conversation_is_not_found_like_a_missing_one(stack, edge_url, tenant_key):
    tenant, key = tenant_key
    mine = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0, timeout=60)
    await mine.chat.completions.create(model=SLOW_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       metadata={"conversation_id": "private-1"})
    other = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=await stack.create_key("intruder", "standard"),
                               max_retries=0, timeout=60)
    errors = []
    for conversation in ("private-1", "never-existed"):
        with pytest.raises(openai.NotFoundError) as exc:
            await other.chat.completions.create(
                model=SLOW_MODEL, messages=[{"role": "user", "content": "what did they say?"}],
                metadata={"conversation_id": conversation, "history": "server"})
        errors.append(exc.value.body)
    assert errors[0]["code"] == errors[1]["code"] == "conversation_not_found"
    assert errors[0]["message"].replace("private-1", "X") == errors[1]["message"].replace("never-existed", "X")


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 10}, "messages", "context_length_exceeded"),
    ({"metadata": {"history": "server"}}, "metadata", "invalid_value"),
    ({"metadata": {"conversation_id": "c", "history": "everything"}}, "metadata", "invalid_value"),
])
async def test_prompts_that_cannot_be_served_are_refused_with_the_numbers(edge_url, auth, body, param, code):
    request = {"model": SLOW_MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        response = await http.post("/v1/chat/completions", json=request, headers=auth)
    error = response.json()["error"]
    assert response.status_code == 400 and (error["param"], error["code"]) == (param, code)
    if code == "context_length_exceeded":
        assert "maximum context length is 300 tokens" in error["message"] and "(504 in the messages, 10" in error["message"]


async def test_the_cache_and_the_store_give_the_same_turns(stack, edge_url, tenant_key):
    """Loaded twice through the edge's own ConversationHistory: from Redis, then after a flush."""
    tenant, key = tenant_key
    client = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0, timeout=60)
    for i in range(3):
        await client.chat.completions.create(model=SLOW_MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                                             max_tokens=3, metadata={"conversation_id": "twice", "history": "server"}
                                             if i else {"conversation_id": "twice"})
    store = SqliteTranscriptStore(stack.transcripts_path)
    cache = redis.Redis.from_url(stack.settings.redis_url)
    history = ConversationHistory(cache, stack.settings.redis_prefix, lambda: store, turns=64, ttl_s=60, wait_s=2)
    try:
        for _ in range(50):  # the third turn reaches the store
            conversation = await store.get_conversation(tenant, "twice")
            if conversation and len((await history.load(tenant, "twice")).turns) == 3:
                break
            await asyncio.sleep(0.1)
        cached = await history.load(tenant, "twice")
        await cache.delete(f"{stack.settings.redis_prefix}history:{tenant}:twice")
        rebuilt = await history.load(tenant, "twice")
    finally:
        await cache.aclose()
        await store.close()
    assert cached == rebuilt and [t.messages[0].content for t in rebuilt.turns] == ["q0", "q1", "q2"]
