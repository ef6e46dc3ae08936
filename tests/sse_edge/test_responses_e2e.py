"""OpenAI's Responses API through the real embedded stack, with the official openai client: a turn
answered whole and streamed as named events, stored and continued with ``previous_response_id``,
function calls and their outputs given back, retrieval, input items, deletion, and the errors a
client gets for what is not served. (What becomes of a turn whose client or edge goes:
test_responses_recovery_e2e.py.)"""

import json
import signal
import uuid

import httpx
import openai
import pytest
from openai.pagination import SyncCursorPage
from openai.types.responses import Response, ResponseItem, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.conftest import MODEL, SLOW_MODEL
from tests.expected import expected_calls, expected_output
from tests.sse_edge.responses_helpers import another_edge, up_to_the_first_delta
from tests.sse_edge.test_history_e2e import requests_on_the_bus
from tests.sse_edge.test_openai_client import Trip
from tests.sse_edge.test_tool_calls_e2e import QUESTION, WEATHER, specs
from tests.stream_processors.helpers import eventually

pytestmark = pytest.mark.stack

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


async def test_a_turn_is_answered_whole_and_stored(client):
    response = await client.responses.create(model=MODEL, input="Name a river.", instructions="Be brief.",
                                             extra_body={"seed": 21})
    expected = await expected_output([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Name a river."}], seed=21)
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == expected.text and response.model == MODEL
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.usage.input_tokens == expected.prompt_tokens
    assert response.usage.output_tokens == expected.completion_tokens
    assert response.usage.total_tokens == expected.prompt_tokens + expected.completion_tokens
    assert response.instructions == "Be brief." and response.store is True

    again = await client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()
    items = await client.responses.input_items.list(response.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Name a river.")]


async def test_a_streamed_turn_is_the_responses_api_events_in_order(client):
    stream = await client.responses.create(model=MODEL, input="Tell me about the sea.", stream=True,
                                           extra_body={"seed": 22})
    events = [event async for event in stream]
    expected = await expected_output([{"role": "user", "content": "Tell me about the sea."}], seed=22)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected.text and len(deltas) > 1
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.status == "completed" and done.output_text == expected.text
    assert done.usage.output_tokens == expected.completion_tokens
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {done.output[0].id}
    # Stored before the stream said it ended: retrievable at once.
    assert (await client.responses.retrieve(done.id)).output_text == expected.text


async def test_on_the_wire_each_event_is_named_as_its_type_and_no_done_follows(edge_url, auth):
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        answered = await http.post("/responses", json={"model": MODEL, "input": "Hi.", "stream": True})
    assert answered.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in answered.text.split("\n\n") if b.strip() and not b.startswith(":")]
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = STREAM_EVENT.validate_python(json.loads(data[len("data: "):]))  # as strictly as the client's types say
        assert event.type == name[len("event: "):]
    assert blocks[-1].startswith("event: response.completed") and "[DONE]" not in answered.text
    assert answered.headers["x-request-id"] == json.loads(blocks[0].split("data: ")[1])["response"]["id"]
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        whole = await http.post("/responses", json={"model": MODEL, "input": "Hi.", "tools": [FLAT_WEATHER]})
        items = await http.get(f"/responses/{whole.json()['id']}/input_items")
    assert Response.model_validate(whole.json()).status == "completed"
    assert SyncCursorPage[ResponseItem].model_validate(items.json()).data[0].type == "message"


async def test_previous_response_id_continues_the_chain(client, stack, edge_url, auth):
    first = await client.responses.create(model=MODEL, input="Hello.", instructions="Speak plainly.",
                                          extra_body={"seed": 23})
    second = await client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                           extra_body={"seed": 24})
    # The first turn's instructions are not carried over; its input and answer are.
    chain = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And then?"}]
    expected = await expected_output(chain, seed=24)
    assert second.output_text == expected.text and second.previous_response_id == first.id
    assert second.usage.input_tokens == expected.prompt_tokens

    # The chain is one conversation in the transcripts, named by its first response, each turn's
    # new messages once; and on the bus, keyed by it (its turns go where its prefix is cached).
    async def transcript():
        answered = await http.get(f"/conversations/{first.id}/messages")
        rows = answered.json()["data"] if answered.status_code == 200 else []
        return rows if len(rows) == 5 else None

    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        rows = await eventually(transcript)
    assert [(m["role"], m["content"]) for m in rows] == [
        ("system", "Speak plainly."), ("user", "Hello."), ("assistant", first.output_text), ("user", "And then?"),
        ("assistant", second.output_text)]
    published = await requests_on_the_bus(stack, {second.id}, MODEL)
    assert published[second.id].conversation_id == first.id

    third = await client.responses.create(model=MODEL, input="Last one.", previous_response_id=second.id,
                                          instructions="Be brief.", stream=True, extra_body={"seed": 25})
    done = [e async for e in third][-1].response
    longer = [{"role": "system", "content": "Be brief."}, *chain,
              {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Last one."}]
    assert done.output_text == (await expected_output(longer, seed=25)).text


async def test_function_calls_and_their_outputs_round_trip(client):
    question = QUESTION[0]["content"]
    first = await client.responses.create(model=MODEL, input=question, tools=[FLAT_WEATHER],
                                          parallel_tool_calls=False, extra_body={"seed": 11})
    expected = await expected_calls(QUESTION, specs(WEATHER), seed=11, parallel=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    assert first.tools[0].name == "get_weather" and first.status == "completed"

    # The call's output, given back with the chain: the model answers in words.
    second = await client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[FLAT_WEATHER], extra_body={"seed": 11},
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "3 C and rain"}])
    assert second.output_text and not [i for i in second.output if i.type == "function_call"]
    # As typed clients read them (openai's models, validated): the response with its calls, and
    # the item given back.
    Response.model_validate((await client.responses.with_raw_response.retrieve(first.id)).http_response.json())
    given = await client.responses.input_items.with_raw_response.list(second.id)
    assert ResponseItemList.model_validate(given.http_response.json()).data[0].type == "function_call_output"

    # The same, stateless: the calls and their outputs given back as input items (store off).
    streamed = await client.responses.create(model=MODEL, input=question, tools=[FLAT_WEATHER], stream=True,
                                             parallel_tool_calls=False, store=False, extra_body={"seed": 11})
    events = [e async for e in streamed]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done_call,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(arguments) == expected[0][1] and done_call.arguments == arguments
    call = [i for i in events[-1].response.output if i.type == "function_call"][0]
    replayed = await client.responses.create(model=MODEL, store=False, tools=[FLAT_WEATHER], extra_body={"seed": 11},
                                             input=[{"role": "user", "content": question},
                                                    call.model_dump(exclude_none=True),
                                                    {"type": "function_call_output", "call_id": call.call_id,
                                                     "output": "3 C and rain"}])
    assert replayed.output_text == second.output_text  # the same prompt, however it was given
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(replayed.id)  # not stored


async def test_a_token_limit_ends_a_response_incomplete(client):
    response = await client.responses.create(model=MODEL, input="Go on at length.", max_output_tokens=3,
                                             extra_body={"seed": 26})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


async def test_stored_responses_are_the_tenants_own_and_can_be_deleted(stack, edge_url, client):
    made = await client.responses.create(model=MODEL, input="Mine.", extra_body={"seed": 27})
    other_key = await stack.create_key(f"resp-{uuid.uuid4().hex[:6]}", "standard")
    other = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=other_key, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as refused:
        await other.responses.create(model=MODEL, input="Yours?", previous_response_id=made.id)
    assert refused.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(made.id)

    await client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(made.id)


async def test_what_is_not_served_gets_an_openai_error_naming_it(edge_url, auth):
    cases = {
        "tools[0].type": {"input": "x", "tools": [{"type": "web_search_preview"}]},
        "input[0].content[0].type": {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
        "input[0].type": {"input": [{"type": "reasoning", "summary": []}]},
        "background": {"input": "x", "background": True, "store": False},
        "max_output_tokens": {"input": "x", "max_output_tokens": 10**9},
        "text.format": {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
        "input[1].call_id": {"input": [{"role": "user", "content": "x"},
                                       {"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input": {"input": []},
        "previous_response_id": {"input": "x", "previous_response_id": "resp_" + "0" * 32},
        "context_management": {"input": "x", "context_management": [{"type": "compaction", "compact_threshold": 9}]},
        "max_tool_calls": {"input": "x", "max_tool_calls": -1},
    }
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        for param, body in cases.items():
            refused = await http.post("/responses", json={"model": MODEL, **body})
            assert refused.status_code == 400, (param, refused.text)
            assert refused.json()["error"]["param"].startswith(param), (param, refused.json())
        missing = await http.get("/responses/resp_nope")
        items = await http.get("/responses/resp_nope/input_items")
    assert missing.status_code == 404 and items.status_code == 404


async def test_a_cap_on_built_in_tool_calls_caps_nothing_here_and_is_repeated(client):
    """OpenAI's ``max_tool_calls`` counts calls to built-in tools, which tokenbus has none of: a
    turn offering functions is served as without it, and its response says it back."""
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]
    capped = await client.responses.create(model=MODEL, input="Weather?", tools=tools, tool_choice="required",
                                           max_tool_calls=1, safety_identifier="user-7", extra_body={"seed": 9})
    plain = await client.responses.create(model=MODEL, input="Weather?", tools=tools, tool_choice="required",
                                          extra_body={"seed": 9})
    assert capped.max_tool_calls == 1 and plain.max_tool_calls is None
    assert capped.safety_identifier == "user-7"  # (OpenAI's end-user id: repeated, as it is)
    assert [(o.type, o.name, o.arguments) for o in capped.output] == [(o.type, o.name, o.arguments) for o in plain.output]
    assert capped.output[0].type == "function_call"


async def test_token_scores_come_when_included(client):
    response = await client.responses.create(model=MODEL, input="Score me.", include=["message.output_text.logprobs"],
                                             top_logprobs=2, extra_body={"seed": 28})
    (part,) = response.output[0].content
    assert len(part.logprobs) == response.usage.output_tokens
    assert "".join(s.token for s in part.logprobs) == part.text
    assert all(len(s.top_logprobs) == 2 and s.logprob <= 0 for s in part.logprobs)
    plain = await client.responses.create(model=MODEL, input="Score me.", extra_body={"seed": 28})
    assert plain.output[0].content[0].logprobs is None and plain.output_text == part.text


async def test_truncation_auto_leaves_out_the_oldest_turns_that_do_not_fit(stack, edge_url, api_key):
    """SLOW_MODEL has a 300-token window on the test stack: a chain outgrows it in a few turns."""
    client = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)
    long_input = " ".join(["word"] * 60)
    previous, ids = None, []
    for _ in range(3):
        made = await client.responses.create(model=SLOW_MODEL, input=long_input, max_output_tokens=6,
                                             previous_response_id=previous)
        previous = made.id
        ids.append(made.id)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=SLOW_MODEL, input=long_input, max_output_tokens=6,
                                      previous_response_id=previous)
    assert refused.value.code == "context_length_exceeded"
    fitted = await client.responses.create(model=SLOW_MODEL, input=long_input, max_output_tokens=6,
                                           previous_response_id=previous, truncation="auto")
    assert fitted.status == "incomplete" and fitted.truncation == "auto"
    published = (await requests_on_the_bus(stack, {ids[-1], fitted.id}))[fitted.id]
    users = [m for m in published.messages if m.role == "user"]
    assert 1 < len(users) < 4  # the newest turns that fit, then its own input
    assert published.estimated_prompt_tokens + 6 <= 300


async def test_an_idempotency_key_answers_a_repeat_with_the_same_response(client, edge_url, auth):
    once = {"Idempotency-Key": f"resp-{uuid.uuid4().hex}"}
    first = await client.responses.create(model=MODEL, input="Only once.", extra_body={"seed": 29}, extra_headers=once)
    repeat = await client.responses.create(model=MODEL, input="Only once.", extra_body={"seed": 29}, extra_headers=once)
    assert repeat.model_dump() == first.model_dump()

    streamed_key = f"resp-{uuid.uuid4().hex}"
    live = [e async for e in await client.responses.create(
        model=MODEL, input="Stream once.", stream=True, extra_body={"seed": 30},
        extra_headers={"Idempotency-Key": streamed_key})]
    replayed = [e async for e in await client.responses.create(
        model=MODEL, input="Stream once.", stream=True, extra_body={"seed": 30},
        extra_headers={"Idempotency-Key": streamed_key})]
    # The stream read again from the log: event for event as it went out live.
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in live]
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        reused = await http.post("/responses", json={"model": MODEL, "input": "Something else."},
                                 headers={"Idempotency-Key": streamed_key})
    assert reused.status_code == 409 and reused.json()["error"]["code"] == "idempotency_key_reused"


async def test_cancel_stops_a_streamed_turn_and_stores_it_cancelled(client):
    stream = await client.responses.create(model=SLOW_MODEL, input="Take your time.", stream=True)
    events = await up_to_the_first_delta(stream)
    response_id = events[0].response.id
    cancelled = await client.responses.cancel(response_id)
    events += [e async for e in stream]
    assert cancelled.id == response_id and cancelled.status == "cancelled"
    assert events[-1].type == "response.failed" and events[-1].response.status == "cancelled"
    assert events[-1].response.error is None  # (as OpenAI's: the status says it)
    assert 0 < events[-1].response.usage.output_tokens < 300  # SLOW_MODEL's 300, cut short
    assert (await client.responses.retrieve(response_id)).status == "cancelled"


async def test_the_clients_stream_helper_accumulates_the_same_response(client):
    async with client.responses.stream(model=MODEL, input="Helper.", tools=[FLAT_WEATHER],
                                       extra_body={"seed": 31}) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    stored = await client.responses.retrieve(final.id)
    assert kinds[-1] == "response.completed" and final.output_text == stored.output_text
    assert [item.id for item in final.output] == [item.id for item in stored.output]


async def test_text_format_asks_for_json_of_its_schema(client):
    """``responses.parse`` with a pydantic model sends ``text.format`` (``json_schema``, strict): the
    answer parses into it, and is what the engine answers a chat request with that schema."""
    parsed = await client.responses.parse(model=MODEL, input="Plan a trip.", text_format=Trip, extra_body={"seed": 61})
    assert isinstance(parsed.output_parsed, Trip) and parsed.status == "completed"
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Trip"
    expected = await expected_output([{"role": "user", "content": "Plan a trip."}], seed=61,
                                     response_format="json_schema", json_schema=json.dumps(Trip.model_json_schema()))
    assert parsed.output_text == expected.text
    plain = await client.responses.create(model=MODEL, input="Plan a trip.", text={"format": {"type": "json_object"}},
                                          extra_body={"seed": 61})
    assert isinstance(json.loads(plain.output_text), dict)


async def test_an_edge_that_stores_no_responses_serves_each_as_not_stored(stack, api_key):
    """``TOKENBUS_EDGE_STORE_RESPONSES=false``: nothing of a turn is kept at the edge, whatever the
    request says (a chat completion's ``store`` too); a background response, which must be stored,
    is refused."""
    edge, client = another_edge(stack, api_key, "edge-no-store", "4", {"TOKENBUS_EDGE_STORE_RESPONSES": "false"})
    try:
        answered = await client.responses.create(model=MODEL, input="Forget me.", extra_body={"seed": 37})
        assert answered.status == "completed" and answered.store is False and answered.output_text
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(answered.id)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, input="Later.", background=True)
        assert refused.value.body["param"] == "background"
        with pytest.raises(openai.BadRequestError) as refused:  # nor a conversation kept
            await client.responses.create(model=MODEL, input="Later.", conversation=f"conv_{uuid.uuid4().hex}")
        assert refused.value.body["param"] == "conversation"
        with pytest.raises(openai.BadRequestError) as refused:
            await client.conversations.create()
        assert refused.value.body["code"] == "conversations_not_stored"
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Forget."}],
                                                    max_tokens=4, store=True)  # nor a chat completion
        assert chat.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.retrieve(chat.id)
        assert refused.value.body["code"] == "completions_not_stored"
    finally:
        edge.signal(signal.SIGTERM)
