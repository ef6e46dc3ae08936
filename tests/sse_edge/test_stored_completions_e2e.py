"""OpenAI's stored chat completions through the real embedded stack, with the official openai
client: completions asked with ``store: true`` (whole, streamed, with several choices, with tool
calls) retrieved as they were answered, listed by model and metadata a page at a time, their
messages listed, their metadata replaced, deleted; one asked without it, or failed, not kept; a
tenant's completions its own."""

import uuid

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.expected import expected_output

pytestmark = pytest.mark.stack


def client_of(edge_url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture
async def tenant_client(stack, edge_url):
    """A client of a tenant of its own: its listings hold only what the test stored."""
    return client_of(edge_url, await stack.create_key(f"tenant-{uuid.uuid4().hex[:8]}", "standard"))


async def test_a_stored_completion_is_retrieved_as_answered_with_its_messages_and_metadata(tenant_client):
    client = tenant_client
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    answered = await client.chat.completions.create(model=MODEL, messages=messages, seed=3, store=True,
                                                    metadata={"topic": "colours"})
    expected = await expected_output([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Name a colour."}], seed=3)
    assert answered.choices[0].message.content == expected.text

    stored = await client.chat.completions.retrieve(answered.id)
    assert stored.model_dump(exclude={"metadata"}) == answered.model_dump(exclude={"metadata"})
    assert stored.metadata == {"topic": "colours"}

    listed = [m async for m in client.chat.completions.messages.list(answered.id)]
    assert [(m.id, m.role, m.content) for m in listed] == [(f"{answered.id}-0", "system", "Be brief."),
                                                           (f"{answered.id}-1", "user", "Name a colour.")]
    assert listed[0].content_parts is None and [p.text for p in listed[1].content_parts] == ["Name a ", "colour."]
    newest_first = await client.chat.completions.messages.list(answered.id, order="desc", limit=1)
    assert [m.id for m in newest_first.data] == [f"{answered.id}-1"] and newest_first.has_more

    updated = await client.chat.completions.update(answered.id, metadata={"topic": "paint", "reviewed": "yes"})
    assert updated.id == answered.id and updated.metadata == {"topic": "paint", "reviewed": "yes"}
    assert (await client.chat.completions.retrieve(answered.id)).metadata["topic"] == "paint"

    deleted = await client.chat.completions.delete(answered.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (answered.id, "chat.completion.deleted", True)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.retrieve(answered.id)
    assert [c.id async for c in client.chat.completions.list()] == []


async def test_a_streamed_completion_is_stored_as_its_chunks_join_up(tenant_client):
    """The stored completion is what a client joining the stream's chunks holds, usage included,
    there by the time the stream has ended; with several choices, each of them."""
    client = tenant_client
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on."}],
                                                  seed=5, n=2, stream=True, store=True)
    chunks = [chunk async for chunk in stream]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)]
    stored = await client.chat.completions.retrieve(chunks[0].id)
    assert stored.object == "chat.completion" and stored.created == chunks[0].created
    assert [c.message.content for c in stored.choices] == texts and texts[0] != texts[1]
    assert [c.finish_reason for c in stored.choices] == [
        next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == i and
             c.choices[0].finish_reason) for i in (0, 1)]
    whole = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on."}],
                                                 seed=5, n=2)
    assert stored.usage == whole.usage  # (the prompt counted once, as billing counts it)

    calls = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], seed=8, store=True, stream=True,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
        tool_choice="required")
    call_chunks = [chunk async for chunk in calls]
    [call] = (await client.chat.completions.retrieve(call_chunks[0].id)).choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id == next(
        c.choices[0].delta.tool_calls[0].id for c in call_chunks if c.choices and c.choices[0].delta.tool_calls)


async def test_listing_goes_in_order_a_page_at_a_time_by_model_and_metadata(tenant_client):
    client = tenant_client
    made = []
    for i in range(5):
        answered = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Question {i}."}], seed=i, max_tokens=4, store=True,
            metadata={"batch": "even" if i % 2 == 0 else "odd", "n": str(i)})
        made.append(answered.id)
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Not kept."}],
                                         max_tokens=4)  # store defaults to false

    assert [c.id async for c in client.chat.completions.list(limit=2)] == made  # oldest first, paged through
    first_page = await client.chat.completions.list(limit=2, order="desc")
    assert [c.id for c in first_page.data] == [made[4], made[3]] and first_page.has_more
    next_page = await client.chat.completions.list(limit=2, order="desc", after=first_page.data[-1].id)
    assert [c.id for c in next_page.data] == [made[2], made[1]]
    even = await client.chat.completions.list(metadata={"batch": "even"})
    assert [c.id for c in even.data] == [made[0], made[2], made[4]] and not even.has_more
    assert [c.id for c in (await client.chat.completions.list(metadata={"batch": "even", "n": "2"})).data] == [made[2]]
    assert (await client.chat.completions.list(model=MODEL, limit=100)).data[0].id == made[0]
    assert (await client.chat.completions.list(model="another-model")).data == []
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.list(after="chatcmpl-" + "0" * 32)
    assert refused.value.body["code"] == "invalid_cursor"


async def test_a_tenants_stored_completions_are_its_own(stack, edge_url, tenant_client):
    answered = await tenant_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Mine."}], max_tokens=4, store=True)
    other = client_of(edge_url, await stack.create_key(f"tenant-{uuid.uuid4().hex[:8]}", "standard"))
    for attempt in (other.chat.completions.retrieve(answered.id), other.chat.completions.delete(answered.id),
                    other.chat.completions.update(answered.id, metadata={"x": "y"}),
                    other.chat.completions.messages.list(answered.id)):
        with pytest.raises(openai.NotFoundError):
            await attempt
    assert [c.id async for c in other.chat.completions.list()] == []
    assert (await tenant_client.chat.completions.retrieve(answered.id)).metadata == {}


async def test_what_is_refused_is_said_in_openais_error_format(tenant_client, edge_url, stack):
    client = tenant_client
    answered = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}],
                                                    max_tokens=4, store=True)
    async with httpx.AsyncClient(base_url=edge_url, timeout=10, headers={"Authorization": f"Bearer {client.api_key}"}) as http:
        not_metadata = await http.post(f"/v1/chat/completions/{answered.id}", json={"metadata": {"k": "v"}, "seed": 1})
        too_many = await http.post(f"/v1/chat/completions/{answered.id}",
                                   json={"metadata": {f"k{i}": "v" for i in range(17)}})
        unknown = await http.get("/v1/chat/completions/chatcmpl-nope")
        bad_limit = await http.get("/v1/chat/completions", params={"limit": 101})
    assert (not_metadata.status_code, not_metadata.json()["error"]["code"]) == (400, "unknown_parameter")
    assert (too_many.status_code, too_many.json()["error"]["param"]) == (400, "metadata")
    assert (unknown.status_code, unknown.json()["error"]["param"]) == (404, "completion_id")
    assert (bad_limit.status_code, bad_limit.json()["error"]["param"]) == (400, "limit")
