"""OpenAI's service_tier through the real embedded stack, with the official openai client: a
request runs at the tier it asks for (``flex``: the lowest; ``priority``: the highest, where its
key's tier is), never above its key's, and its response says which in OpenAI's words; on the bus
it is that tier's request (its topic, its moderation policy), and a tier the deployment does not
have is refused."""

import json
import uuid

import httpx
import openai
import pytest
import redis.asyncio as redis

from tests.conftest import MODEL
from tokenbus.schemas import AvroCodec, ChatRequest
from tokenbus.sse_edge.plumbing.streams import StreamRegistry
from tokenbus.topics import TopicCatalog, record_at

pytestmark = pytest.mark.stack


async def published(stack, request_id: str) -> tuple[str, ChatRequest]:
    """The request topic a request landed on, and the request as published there."""
    connection = redis.Redis.from_url(stack.settings.redis_url)
    try:
        record = await StreamRegistry(connection, stack.settings.redis_prefix).get(request_id)
    finally:
        await connection.aclose()
    assert record is not None
    value = await record_at(stack.bus_settings(), record.request_topic, record.request_partition,
                            record.request_offset)
    return record.request_topic, AvroCodec().decode(value, ChatRequest)


async def client_at(stack, edge_url: str, tier: str) -> openai.AsyncOpenAI:
    key = await stack.create_key(f"tenant-{uuid.uuid4().hex[:8]}", tier)
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0, timeout=60)


async def test_a_request_runs_at_the_tier_it_asks_for_never_above_its_keys(stack, edge_url):
    catalog = TopicCatalog(stack.bus_settings())
    standard = await client_at(stack, edge_url, "standard")
    ask = [{"role": "user", "content": "Write to ann@example.com please."}]

    flex = await standard.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, service_tier="flex")
    assert flex.service_tier == "flex"
    topic, request = await published(stack, flex.id)
    assert topic == catalog.requests(MODEL, "batch") and request.tier == "batch"
    assert "[REDACTED:pii_email]" in request.messages[0].content  # the batch tier's policy redacts addresses

    for asked in ("priority", "interactive", None):  # above a standard key's tier, or none asked: its own
        answered = await standard.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                                          **({"service_tier": asked} if asked else {}))
        assert answered.service_tier == "default"
        assert (await published(stack, answered.id))[0] == catalog.requests(MODEL, "standard")
        assert "ann@example.com" in (await published(stack, answered.id))[1].messages[0].content

    interactive = await client_at(stack, edge_url, "interactive")
    priority = await interactive.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                                         service_tier="priority")
    assert priority.service_tier == "priority"
    assert (await published(stack, priority.id))[0] == catalog.requests(MODEL, "interactive")
    lower = await interactive.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                                      service_tier="standard")  # a tier's own name
    assert lower.service_tier == "default" and (await published(stack, lower.id))[1].tier == "standard"


async def test_a_stream_a_stored_completion_and_a_response_run_at_the_tier_asked(stack, edge_url):
    client = await client_at(stack, edge_url, "standard")
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}],
                                                  max_tokens=4, service_tier="flex", stream=True, store=True)
    chunks = [chunk async for chunk in stream]
    assert (await published(stack, chunks[0].id))[1].tier == "batch"
    assert {chunk.service_tier for chunk in chunks} == {"flex"}  # on every chunk, as OpenAI's
    assert (await client.chat.completions.retrieve(chunks[0].id)).service_tier == "flex"
    async with httpx.AsyncClient(base_url=edge_url, timeout=30, headers={"Authorization": f"Bearer {client.api_key}"}) as http:
        again = await http.get(f"/v1/chat/completions/{chunks[0].id}/stream")  # read again: as it first went
        retried = [await http.post("/v1/chat/completions", headers={"Idempotency-Key": "tier-once"}, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Once."}], "max_tokens": 4,
            "service_tier": "flex"}) for _ in range(2)]
    replayed = [json.loads(line[len("data: "):]) for line in again.text.splitlines()
                if line.startswith("data: {")]
    assert len(replayed) == len(chunks) and {c["service_tier"] for c in replayed} == {"flex"}
    assert [r.json()["service_tier"] for r in retried] == ["flex", "flex"]  # the second, the first's stream
    assert retried[0].json()["id"] == retried[1].json()["id"]

    response = await client.responses.create(model=MODEL, input="Hi.", max_output_tokens=16, service_tier="flex")
    assert response.service_tier == "flex" and (await published(stack, response.id))[1].tier == "batch"
    assert (await client.responses.retrieve(response.id)).service_tier == "flex"


async def test_a_tier_the_deployment_does_not_have_is_refused(stack, edge_url):
    client = await client_at(stack, edge_url, "standard")
    for call in (client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}],
                                                service_tier="gold"),
                 client.responses.create(model=MODEL, input="Hi.", service_tier="gold")):
        with pytest.raises(openai.BadRequestError) as refused:
            await call
        assert refused.value.body["param"] == "service_tier" and refused.value.body["code"] == "invalid_value"
        assert "interactive, standard, batch" in refused.value.body["message"]
