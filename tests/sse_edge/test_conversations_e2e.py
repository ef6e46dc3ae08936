"""OpenAI's Conversations API through the real embedded stack, with the official openai client: a
conversation made with items, a Responses turn in it prompted with them and adding its own, items
listed, added, read and deleted, metadata set, the conversation deleted; a tenant's conversations
its own; and the errors a client gets for what is refused."""

import time
import uuid

import httpx
import openai
import pytest
from openai.types.conversations import Conversation, ConversationDeletedResource, ConversationItemList
from openai.types.responses import Response

from tests.conftest import MODEL, SLOW_MODEL
from tests.expected import expected_output
from tests.sse_edge.responses_helpers import until_ended, up_to_the_first_delta
from tests.sse_edge.test_history_e2e import requests_on_the_bus
from tokenbus.stores.conversations import ConversationStore
from tokenbus.stores.redis_client import redis_client

pytestmark = pytest.mark.stack


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def said(role: str, text: str) -> dict:
    return {"role": role, "content": text}


async def all_items(client, conversation_id: str) -> list:
    return [item async for item in client.conversations.items.list(conversation_id, order="asc")]


async def test_a_turn_in_a_conversation_is_prompted_with_its_items_and_adds_its_own(client, stack, edge_url, auth):
    conversation = await client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]}],
        metadata={"topic": "names"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "names"}

    first = await client.responses.create(model=MODEL, input="What is my name?", conversation=conversation.id,
                                          instructions="Be brief.", extra_body={"seed": 41})
    history = [said("user", "My name is Ada."), said("assistant", "Hello Ada."), said("user", "What is my name?")]
    expected = await expected_output([said("system", "Be brief."), *history], seed=41)
    assert first.output_text == expected.text and first.usage.input_tokens == expected.prompt_tokens
    assert first.conversation.id == conversation.id and first.previous_response_id is None

    items = await all_items(client, conversation.id)  # the turn's input and output, after the items it was made with
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"),
                                                 ("message", "user"), ("message", "assistant")]
    assert items[2].content[0].text == "What is my name?" and items[3].id == first.output[0].id
    assert items[3].content[0].text == first.output_text  # (the instructions are not the conversation's)

    # The next turn, streamed, sees all four; on the bus it is keyed by the conversation.
    stream = await client.responses.create(model=MODEL, input="Say it again.", conversation={"id": conversation.id},
                                           stream=True, extra_body={"seed": 42})
    second = [event async for event in stream][-1].response
    longer = [*history, said("assistant", first.output_text), said("user", "Say it again.")]
    assert second.output_text == (await expected_output(longer, seed=42)).text
    assert len(await all_items(client, conversation.id)) == 6
    published = await requests_on_the_bus(stack, {second.id}, MODEL)
    assert published[second.id].conversation_id == conversation.id

    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        listed = (await http.get(f"/conversations/{conversation.id}/items", params={"order": "asc"})).json()
    ConversationItemList.model_validate(listed)  # (openai's models, validated: every field as they type it)
    newest = await client.conversations.items.list(conversation.id, limit=2)  # newest first, OpenAI's default
    assert [i.id for i in newest.data] == [second.output[0].id, (await all_items(client, conversation.id))[4].id]
    assert newest.has_more


async def test_items_are_added_read_and_deleted_and_the_next_turn_sees_what_is_left(client):
    conversation = await client.conversations.create()
    added = await client.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "Remember: the code is 1234."},
        {"type": "message", "role": "user", "content": "Also: the door is blue."}])
    assert isinstance(added, ConversationItemList) and len(added.data) == 2
    code, door = added.data
    assert (await client.conversations.items.retrieve(door.id, conversation_id=conversation.id)).id == door.id

    left = await client.conversations.items.delete(code.id, conversation_id=conversation.id)
    assert isinstance(left, Conversation) and left.id == conversation.id
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.retrieve(code.id, conversation_id=conversation.id)
    answer = await client.responses.create(model=MODEL, input="What do you know?", conversation=conversation.id,
                                           extra_body={"seed": 43})
    expected = await expected_output([said("user", "Also: the door is blue."), said("user", "What do you know?")],
                                     seed=43)
    assert answer.output_text == expected.text

    updated = await client.conversations.update(conversation.id, metadata={"stage": "2"})
    assert updated.metadata == {"stage": "2"}
    assert (await client.conversations.retrieve(conversation.id)).metadata == {"stage": "2"}
    raw = await client.conversations.with_raw_response.retrieve(conversation.id)
    Conversation.model_validate(raw.http_response.json())  # (validated as openai's models type it)
    raw = await client.conversations.with_raw_response.delete(conversation.id)
    deleted = ConversationDeletedResource.model_validate(raw.http_response.json())
    assert deleted.deleted and deleted.id == conversation.id
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=MODEL, input="Still there?", conversation=conversation.id)
    assert refused.value.body["param"] == "conversation" and refused.value.body["code"] == "conversation_not_found"


async def test_a_turn_that_is_cancelled_adds_nothing_to_its_conversation(client):
    conversation = await client.conversations.create(items=[{"role": "user", "content": "Count slowly."}])
    stream = await client.responses.create(model=SLOW_MODEL, input="Go on.", conversation=conversation.id,
                                           stream=True)
    events = await up_to_the_first_delta(stream)
    cancelled = await client.responses.cancel(events[0].response.id)
    assert cancelled.status == "cancelled"
    assert [e async for e in stream][-1].response.status == "cancelled"
    assert [i.content[0].text for i in await all_items(client, conversation.id)] == ["Count slowly."]


async def test_a_background_turn_adds_its_items_without_its_client(client):
    conversation = await client.conversations.create(items=[{"role": "user", "content": "Work on this."}])
    started = await client.responses.create(model=MODEL, input="Go.", conversation=conversation.id, background=True,
                                            extra_body={"seed": 46})
    assert started.status == "in_progress" and started.conversation.id == conversation.id
    done = await until_ended(client, started.id)
    expected = await expected_output([said("user", "Work on this."), said("user", "Go.")], seed=46)
    assert done.status == "completed" and done.output_text == expected.text
    assert [i.id for i in await all_items(client, conversation.id)][-1] == done.output[0].id
    # Seen ended, it has let go of its conversation: the next turn, at once, is not refused.
    after = await client.responses.create(model=MODEL, input="Next.", conversation=conversation.id)
    assert after.status == "completed"


async def test_one_turn_at_a_time_in_a_conversation(stack, edge_url):
    """A turn asked for while another is under way in its conversation is refused, as OpenAI
    refuses it (each would be prompted without the other); once that one has ended, the next is
    prompted with it. A turn that holds a conversation but no longer runs does not keep it: one
    that ended (its reader stopped before letting go), or one never stored as started a minute on."""
    tenant = f"turns-{uuid.uuid4().hex[:6]}"
    client = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=await stack.create_key(tenant, "standard"),
                                max_retries=0, timeout=60)
    conversation = await client.conversations.create(items=[said("user", "Count slowly.")])
    stream = await client.responses.create(model=SLOW_MODEL, input="Go on.", conversation=conversation.id,
                                           stream=True, max_output_tokens=30)
    events = await up_to_the_first_delta(stream)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=MODEL, input="Me too.", conversation=conversation.id)
    assert refused.value.code == "conversation_locked" and refused.value.param == "conversation"
    events += [e async for e in stream]
    assert events[-1].response.status == "incomplete"  # (cut short at 30 tokens: its items are added)
    after = await client.responses.create(model=MODEL, input="Now me.", conversation=conversation.id,
                                          extra_body={"seed": 47})
    first_answer = events[-1].response.output_text
    expected = await expected_output([said("user", "Count slowly."), said("user", "Go on."),
                                      said("assistant", first_answer), said("user", "Now me.")], seed=47)
    assert after.output_text == expected.text

    connection = redis_client(stack.settings.redis_url)
    try:
        conversations = ConversationStore(connection, stack.settings.redis_prefix)
        now_ms = int(time.time() * 1000)
        await conversations.hold_turn(tenant, conversation.id, after.id, now_ms)  # ended, and still holding
        assert (await client.responses.create(model=MODEL, input="Stale.", conversation=conversation.id)).status \
            == "completed"
        await conversations.hold_turn(tenant, conversation.id, "resp_starting", now_ms)  # not stored yet
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, input="Wait.", conversation=conversation.id)
        assert refused.value.code == "conversation_locked"
        await conversations.hold_turn(tenant, conversation.id, "resp_never", now_ms - 61_000, replacing="resp_starting")
        assert (await client.responses.create(model=MODEL, input="Gone.", conversation=conversation.id)).status \
            == "completed"
    finally:
        await connection.aclose()
    assert len(await all_items(client, conversation.id)) == 1 + 4 * 2  # the refused turns added nothing


async def test_a_tenants_conversations_are_its_own(client, stack, edge_url):
    conversation = await client.conversations.create(items=[{"role": "user", "content": "Private."}])
    other_key = await stack.create_key(f"conv-{uuid.uuid4().hex[:6]}", "standard")
    other = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=other_key, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError):
        await other.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        await other.conversations.items.list(conversation.id)
    with pytest.raises(openai.NotFoundError):
        await other.conversations.delete(conversation.id)
    with pytest.raises(openai.BadRequestError):
        await other.responses.create(model=MODEL, input="Read it.", conversation=conversation.id)
    assert len(await all_items(client, conversation.id)) == 1  # nothing the other tenant did reached it


async def test_what_is_refused_gets_an_openai_error_naming_it(edge_url, auth, client):
    conversation = await client.conversations.create()
    earlier: Response = await client.responses.create(model=MODEL, input="Hi.", extra_body={"seed": 44})
    refused = [
        ("conversation", "/responses", {"model": MODEL, "input": "x", "conversation": conversation.id,
                                        "previous_response_id": earlier.id}),
        ("conversation", "/responses", {"model": MODEL, "input": "x", "conversation": conversation.id,
                                        "store": False}),
        ("items", "/conversations", {"items": [{"role": "user", "content": "x"}] * 21}),
        ("items[0].type", f"/conversations/{conversation.id}/items", {"items": [{"type": "reasoning"}]}),
        ("items[1].content[0].type", f"/conversations/{conversation.id}/items", {"items": [
            {"role": "user", "content": "x"},
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]}),
        ("metadata", "/conversations", {"metadata": {"k": "v" * 513}}),
    ]
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        for param, path, body in refused:
            answered = await http.post(path, json=body)
            assert answered.status_code == 400, (param, answered.text)
            assert answered.json()["error"]["param"] == param, answered.text
        assert len((await http.get(f"/conversations/{conversation.id}/items")).json()["data"]) == 0


async def test_an_agents_sdk_session_keeps_its_history_in_a_conversation(client):
    """OpenAI's Agents SDK as it is: an agent on the Responses API whose session is a conversation
    object (``OpenAIConversationsSession``) reads the session's items before each run, sends them
    as the run's input and adds the run's new items after; its second run is prompted with the
    first."""
    from agents import Agent, ModelSettings, Runner, set_tracing_disabled
    from agents.memory import OpenAIConversationsSession
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # (nothing is sent anywhere but the edge)
    agent = Agent(name="helper", instructions="Be brief.", model=OpenAIResponsesModel(MODEL, client),
                  model_settings=ModelSettings(extra_body={"seed": 45}))
    session = OpenAIConversationsSession(openai_client=client)
    first = await Runner.run(agent, "My name is Ada.", session=session)
    second = await Runner.run(agent, "What is my name?", session=session)
    asked = [said("system", "Be brief."), said("user", "My name is Ada.")]
    assert first.final_output == (await expected_output(asked, seed=45)).text
    again = [*asked, said("assistant", first.final_output), said("user", "What is my name?")]
    assert second.final_output == (await expected_output(again, seed=45)).text
    streamed = Runner.run_streamed(agent, "Bye.", session=session)  # the Responses API's events, read by the SDK
    kinds = {event.type async for event in streamed.stream_events()}
    last = [*again, said("assistant", second.final_output), said("user", "Bye.")]
    assert "raw_response_event" in kinds and streamed.final_output == (await expected_output(last, seed=45)).text
    items = await all_items(client, session.session_id)
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "My name is Ada."), ("assistant", first.final_output), ("user", "What is my name?"),
        ("assistant", second.final_output), ("user", "Bye."), ("assistant", streamed.final_output)]


async def test_an_agent_with_a_tool_in_a_server_managed_conversation(client):
    """The Agents SDK's server-managed conversation (``Runner.run(..., conversation_id=...)``): each
    model call sends only what is new, naming the conversation, and the edge prompts it with the
    conversation's items and adds the turn's. A function tool goes round: the model calls it, the
    SDK runs it and sends its output, and the next call answers in words."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    called = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"rain in {city}"

    agent = Agent(name="forecaster", model=OpenAIResponsesModel(MODEL, client), tools=[get_weather],
                  model_settings=ModelSettings(extra_body={"seed": 47}))
    conversation = await client.conversations.create()
    result = await Runner.run(agent, "Weather in Oslo?", conversation_id=conversation.id)
    items = await all_items(client, conversation.id)
    assert len(called) == 1 and result.final_output
    assert [i.type for i in items] == ["message", "function_call", "function_call_output", "message"]
    assert items[1].name == "get_weather" and items[2].call_id == items[1].call_id
    assert items[2].output == f"rain in {called[0]}" and items[3].content[0].text == result.final_output
