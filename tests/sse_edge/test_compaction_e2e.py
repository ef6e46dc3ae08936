"""``POST /v1/responses/compact`` through the real embedded stack, with the official openai client:
a context compacted into its user messages and one compaction item, whose summary is the model's
answer to the summarizing prompt; that item given back as the next turn's input (or added to a
conversation) prompts it with the summary; and the errors a client gets for what is refused."""

import uuid

import httpx
import openai
import pytest
from openai.types.responses import CompactedResponse

from tests.conftest import ALIAS, MODEL
from tests.expected import expected_output
from tokenbus.sse_edge.protocol.compaction import INSTRUCTION, SUMMARY_PREFIX, decode_summary
from tokenbus.sse_edge.settings import EdgeSettings

pytestmark = pytest.mark.stack

SUMMARY_TOKENS = EdgeSettings().history_summary_max_tokens


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def said(role: str, text: str) -> dict:
    return {"role": role, "content": text}


async def summary_of(lines: str, seed: int):
    return await expected_output([said("system", INSTRUCTION), said("user", lines)], seed=seed,
                                 max_tokens=SUMMARY_TOKENS)


async def test_a_context_compacts_to_its_user_messages_and_a_summary_the_next_turn_reads(client):
    context = [said("user", "My name is Ada."), said("assistant", "Hello Ada."),
               {"type": "function_call", "call_id": "call_1", "name": "city", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "Paris"},
               said("user", "I like tea.")]
    compacted = await client.responses.compact(model=MODEL, input=context, extra_body={"seed": 51})
    assert isinstance(compacted, CompactedResponse) and compacted.object == "response.compaction"
    *users, compaction = compacted.output
    assert [(m.type, m.role, m.content[0].text) for m in users] == [
        ("message", "user", "My name is Ada."), ("message", "user", "I like tea.")]
    lines = "user: My name is Ada.\nassistant: Hello Ada.\nassistant called city({})\ntool: Paris\nuser: I like tea."
    summary = await summary_of(lines, seed=51)
    assert compaction.type == "compaction" and compaction.encrypted_content
    assert compacted.usage.input_tokens == summary.prompt_tokens
    assert compacted.usage.output_tokens == summary.completion_tokens

    # Given back in place of what it compacted: the next turn is prompted with the summary.
    given_back = [i.model_dump(exclude_none=True, warnings=False) for i in compacted.output]
    then = await client.responses.create(model=MODEL, input=[*given_back, said("user", "What do I drink?")],
                                         extra_body={"seed": 52})
    expected = await expected_output([said("user", "My name is Ada."), said("user", "I like tea."),
                                      said("system", SUMMARY_PREFIX + summary.text),
                                      said("user", "What do I drink?")], seed=52)
    assert then.output_text == expected.text
    listed = [i async for i in client.responses.input_items.list(then.id, order="asc")]
    assert [i.type for i in listed] == ["message", "message", "compaction", "message"]
    assert listed[2].id == compaction.id and listed[2].encrypted_content == compaction.encrypted_content

    # Added to a conversation, it prompts the conversation's turns the same way.
    conversation = await client.conversations.create(items=[compaction.model_dump(exclude_none=True)])
    items = [i async for i in client.conversations.items.list(conversation.id)]
    assert [(i.type, i.encrypted_content) for i in items] == [("compaction", compaction.encrypted_content)]
    turn = await client.responses.create(model=MODEL, input="Hello again.", conversation=conversation.id,
                                         extra_body={"seed": 53})
    expected = await expected_output([said("system", SUMMARY_PREFIX + summary.text), said("user", "Hello again.")],
                                     seed=53)
    assert turn.output_text == expected.text


async def test_a_chain_compacts_with_its_stored_turns_first(client):
    first = await client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                          extra_body={"seed": 54})
    compacted = await client.responses.compact(model=MODEL, previous_response_id=first.id, input="And I like tea.",
                                               extra_body={"seed": 55})
    *users, compaction = compacted.output
    assert [m.content[0].text for m in users] == ["My name is Ada.", "And I like tea."]
    lines = f"user: My name is Ada.\nassistant: {first.output_text}\nuser: And I like tea."
    summary = await summary_of(lines, seed=55)
    assert (compacted.usage.input_tokens, compacted.usage.output_tokens) == (summary.prompt_tokens,
                                                                             summary.completion_tokens)
    assert compaction.type == "compaction"


async def test_what_is_refused_gets_an_openai_error_naming_it(client, stack, edge_url, auth):
    other_key = await stack.create_key(f"compact-{uuid.uuid4().hex[:6]}", "standard")
    other = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=other_key, max_retries=0, timeout=30)
    theirs = await other.responses.create(model=MODEL, input="Private.", extra_body={"seed": 56})
    forged = {"type": "compaction", "encrypted_content": "gAAAAABo-not-ours"}
    refused = [
        (400, "input", "/responses/compact", {"model": MODEL}),
        (400, "previous_response_id", "/responses/compact", {"model": MODEL, "previous_response_id": theirs.id}),
        (400, "input[1].type", "/responses/compact", {"model": MODEL, "input": [said("user", "x"),
                                                                                 {"type": "reasoning"}]}),
        (400, "input[0].encrypted_content", "/responses", {"model": MODEL, "input": [forged, said("user", "x")]}),
        (404, "model", "/responses/compact", {"model": "no-such-model", "input": "x"}),
        (400, "input", "/responses/compact", {"model": MODEL, "input": "x" * EdgeSettings().max_prompt_chars}),
    ]
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        for status, param, path, body in refused:
            answered = await http.post(path, json=body)
            assert answered.status_code == status, (param, answered.text)
            assert answered.json()["error"]["param"] == param, answered.text


async def test_an_agents_sdk_compaction_session_compacts_its_history_on_the_edge(client, tmp_path):
    """OpenAI's Agents SDK as it is: ``OpenAIResponsesCompactionSession`` (which takes only OpenAI's
    model names: the edge serves ALIAS with MODEL) compacts the session's history after a run
    with ``responses.compact``, and replaces it with the compacted items; the next run sends them,
    and is prompted with the summary in place of what it compacted."""
    from agents import Agent, ModelSettings, Runner, SQLiteSession, set_tracing_disabled
    from agents.memory import OpenAIResponsesCompactionSession
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # (nothing is sent anywhere but the edge)
    agent = Agent(name="helper", model=OpenAIResponsesModel(ALIAS, client),
                  model_settings=ModelSettings(extra_body={"seed": 57}))
    session = OpenAIResponsesCompactionSession(
        "compacted", SQLiteSession("compacted", str(tmp_path / "session.db")), client=client, model=ALIAS,
        should_trigger_compaction=lambda context: len(context["session_items"]) >= 4)
    await Runner.run(agent, "My name is Ada.", session=session)
    assert [i.get("type", "message") for i in await session.get_items()] == ["message", "message"]  # not yet
    second = await Runner.run(agent, "I like tea.", session=session)
    kept = await session.get_items()
    assert [(i.get("type", "message"), i.get("role")) for i in kept] == [
        ("message", "user"), ("message", "user"), ("compaction", None)]
    summary = decode_summary(kept[-1]["encrypted_content"])  # (the SDK sends no seed: the text is the model's)
    assert summary and second.final_output

    third = await Runner.run(agent, "What do I drink?", session=session)
    prompt = [said("user", "My name is Ada."), said("user", "I like tea."), said("system", SUMMARY_PREFIX + summary),
              said("user", "What do I drink?")]
    assert third.final_output == (await expected_output(prompt, seed=57)).text
