"""OpenAI's Responses API through the real embedded stack, with the official openai client: a turn
answered whole and streamed as named events, stored and continued with ``previous_response_id``,
function calls and their outputs given back, retrieval, input items, deletion, and the errors a
client gets for what is not served."""

import asyncio
import json
import signal
import uuid

import httpx
import openai
import pytest
from openai.pagination import SyncCursorPage
from openai.types.responses import Response, ResponseItem, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.conftest import MODEL, SLOW_MODEL, SLOW_SETTINGS
from tests.expected import expected_calls, expected_output
from tests.sse_edge.test_history_e2e import requests_on_the_bus
from tests.sse_edge.test_openai_client import Trip
from tests.sse_edge.test_tool_calls_e2e import QUESTION, WEATHER, specs
from tests.stream_processors.helpers import eventually
from tokenbus.infra.devstack.processes import free_port
from tokenbus.stores.redis_client import redis_client
from tokenbus.stores.responses import ResponseStore

pytestmark = pytest.mark.stack

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
SHORT_LEASE = {"TOKENBUS_EDGE_READER_LEASE_S": "3"}  # an edge to kill: its responses are taken over 3 s after


def another_edge(stack, api_key: str, name: str, reply_partitions: str, env: dict[str, str] | None = None):
    """An edge of its own beside the stack's (to kill, or to set up otherwise), and a client of it."""
    port = free_port()
    process = stack.start_edge(name, port, reply_partitions=reply_partitions, env=env)
    return process, openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0,
                                       timeout=30)


async def up_to_the_first_delta(stream) -> list:
    """A stream's events read up to its first text delta (the stream left open)."""
    events = []
    async for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            break
    return events


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
    }
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        for param, body in cases.items():
            refused = await http.post("/responses", json={"model": MODEL, **body})
            assert refused.status_code == 400, (param, refused.text)
            assert refused.json()["error"]["param"].startswith(param), (param, refused.json())
        missing = await http.get("/responses/resp_nope")
        items = await http.get("/responses/resp_nope/input_items")
    assert missing.status_code == 404 and items.status_code == 404


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


async def test_a_stream_resumed_after_an_event_is_the_rest_of_it_on_any_reader(client, api_key, edge_url):
    stream = await client.responses.create(model=SLOW_MODEL, input="Resume me.", max_output_tokens=40, stream=True,
                                           extra_body={"seed": 32})
    first = []
    async for event in stream:
        first.append(event)
        if len(first) == 6:
            break
    await stream.close()  # the client goes away mid-stream, and comes back within the grace window
    response_id = first[0].response.id
    rest = [e async for e in await client.responses.retrieve(response_id, stream=True,
                                                               starting_after=first[-1].sequence_number)]
    whole = [e async for e in await client.responses.retrieve(response_id, stream=True)]
    assert [e.model_dump() for e in first + rest] == [e.model_dump() for e in whole]
    assert rest[0].sequence_number == 6 and whole[-1].type == "response.incomplete"  # SLOW_MODEL: 300 tokens
    stored = await client.responses.retrieve(response_id)  # stored by the reader that reached the end
    assert stored.status == "incomplete" and stored.usage.output_tokens == 40
    assert stored.output_text == "".join(e.delta for e in whole if e.type == "response.output_text.delta")


async def test_a_background_response_is_generated_without_its_client(client):
    started = await client.responses.create(model=MODEL, input="In the background.", background=True,
                                            extra_body={"seed": 33})
    assert started.status == "in_progress" and started.background and started.output == []
    expected = await expected_output([{"role": "user", "content": "In the background."}], seed=33)
    done = await until_ended(client, started.id)
    assert done.status == "completed" and done.output_text == expected.text and done.background

    # Streamed in the background: the client may go; the response is generated and stored all the same.
    stream = await client.responses.create(model=SLOW_MODEL, input="Go on without me.", max_output_tokens=30,
                                           background=True, stream=True, extra_body={"seed": 34})
    events = await up_to_the_first_delta(stream)
    await stream.close()
    response_id = events[0].response.id
    with pytest.raises(openai.BadRequestError) as refused:  # (SLOW_MODEL: 30 tokens take 0.6 s)
        await client.responses.create(model=MODEL, input="Next.", previous_response_id=response_id)
    assert refused.value.code == "previous_response_in_progress"
    done = await until_ended(client, response_id)
    assert done.status == "incomplete" and done.usage.output_tokens == 30
    assert done.output_text.startswith(events[-1].delta)


async def until_ended(client, response_id):
    for _ in range(400):
        response = await client.responses.retrieve(response_id)
        if response.status != "in_progress":
            return response
        await asyncio.sleep(0.05)
    raise AssertionError(f"{response_id} is still in progress")


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


async def test_a_stream_resumes_on_another_edge_after_the_first_is_killed(stack, edge_url, api_key):
    """The edge serving a Responses stream dies mid-turn: the client reads the rest on another edge
    from the log, event for event, and that edge, reaching the end, stores the response."""
    doomed, first_edge = another_edge(stack, api_key, "edge-responses", "2")
    stream = await first_edge.responses.create(model=SLOW_MODEL, input="A long story.", max_output_tokens=60,
                                               stream=True, extra_body={"seed": 35})
    got = []
    async for event in stream:
        got.append(event)
        if len(got) == 10:
            break
    doomed.signal(signal.SIGKILL)
    await stream.close()
    response_id = got[0].response.id
    other_edge = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=30)
    rest = [e async for e in await other_edge.responses.retrieve(response_id, stream=True,
                                                                   starting_after=got[-1].sequence_number)]
    events = got + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    expected = await expected_output([{"role": "user", "content": "A long story."}], seed=35, max_tokens=60,
                                     settings=SLOW_SETTINGS)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == expected.text
    stored = await other_edge.responses.retrieve(response_id)  # stored by the edge that read it to the end
    assert stored.status == "incomplete" and stored.output[0].id == got[2].item.id


async def test_a_background_response_whose_edge_is_killed_is_finished_by_another(stack, edge_url, api_key):
    """The edge reading a background response dies: once its reader's lease lapses, the next edge
    asked about the response reads its stream from the log to the end and stores it."""
    doomed, first_edge = another_edge(stack, api_key, "edge-background", "3", SHORT_LEASE)
    started = await first_edge.responses.create(model=SLOW_MODEL, input="Work on without me.", max_output_tokens=40,
                                                background=True, extra_body={"seed": 36})
    doomed.signal(signal.SIGKILL)
    other_edge = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=30)
    assert (await other_edge.responses.retrieve(started.id)).status == "in_progress"  # (the dead edge's lease holds)
    done = await until_ended(other_edge, started.id)
    expected = await expected_output([{"role": "user", "content": "Work on without me."}], seed=36, max_tokens=40,
                                     settings=SLOW_SETTINGS)
    assert done.status == "incomplete" and done.output_text == expected.text and done.usage.output_tokens == 40


async def as_stored(stack, edge_url: str, api_key: str, response_id: str) -> dict:
    """A response as the store holds it, read without asking an edge (which would read it on)."""
    async with httpx.AsyncClient(timeout=30) as http:
        tenant = (await http.get(f"{edge_url}/v1/keys/self", headers={"Authorization": f"Bearer {api_key}"})).json()
    connection = redis_client(stack.settings.redis_url)
    try:
        stored = await ResponseStore(connection, stack.settings.redis_prefix, ttl_s=60).get(tenant["tenant"],
                                                                                           response_id)
    finally:
        await connection.aclose()
    assert stored is not None
    return json.loads(stored.body)


async def test_a_streamed_response_whose_client_goes_is_stored_as_it_ended_unasked(stack, edge_url, api_key, client):
    """The client of a stored, streamed turn goes mid-stream and never comes back: its generation
    is cancelled after the grace window, and the edge that served it, reading on from the log,
    stores the response cancelled, with what was generated; nobody has to ask about it."""
    stream = await client.responses.create(model=SLOW_MODEL, input="Leave me.", stream=True, extra_body={"seed": 38})
    got = await up_to_the_first_delta(stream)
    await stream.close()
    response_id = got[0].response.id

    async def ended():
        stored = await as_stored(stack, edge_url, api_key, response_id)
        return stored if stored["status"] != "in_progress" else None

    stored = await eventually(ended)
    assert stored["status"] == "cancelled" and stored["error"] is None
    (message,) = stored["output"]
    assert 0 < stored["usage"]["output_tokens"] < 300 and message["content"][0]["text"].startswith(got[-1].delta)
    assert (await client.responses.retrieve(response_id)).status == "cancelled"


async def test_a_whole_answer_whose_client_goes_is_stored_as_it_ended(stack, edge_url, api_key, auth):
    """A stored turn answered whole, its client gone before the answer: the response is stored as
    it ended (cancelled, after the grace window), unasked."""
    asked = f"Answer me whole, {uuid.uuid4().hex}."
    async with httpx.AsyncClient(timeout=30) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{edge_url}/v1/responses", json={"model": SLOW_MODEL, "input": asked, "seed": 39},
                            headers=auth, timeout=1.0)

    async def ended():  # (its id never reached the client: found by its input, in the store)
        connection = redis_client(stack.settings.redis_url)
        try:
            async for key in connection.scan_iter(match=f"{stack.settings.redis_prefix}response:resp_*"):
                if not key.endswith(b":reader") and asked in (await connection.hget(key, "input_items")).decode():
                    stored = await as_stored(stack, edge_url, api_key, key.decode().rsplit(":", 1)[1])
                    return stored if stored["status"] != "in_progress" else None
        finally:
            await connection.aclose()
        return None

    response = await eventually(ended)
    assert response["status"] == "cancelled" and response["error"] is None
    (message,) = response["output"]
    assert 0 < response["usage"]["output_tokens"] < 300 and message["content"][0]["text"]


async def test_a_streamed_response_whose_edge_is_killed_is_finished_by_the_next_edge_asked(stack, edge_url, api_key):
    """The edge serving a stored, streamed turn dies and its client does not resume: once the dead
    edge's lease lapses, the next edge asked about the response reads it from the log to the end."""
    doomed, first_edge = another_edge(stack, api_key, "edge-foreground", "5", SHORT_LEASE)
    stream = await first_edge.responses.create(model=SLOW_MODEL, input="Do not wait for me.", max_output_tokens=40,
                                               stream=True, extra_body={"seed": 40})
    first = await anext(aiter(stream))
    doomed.signal(signal.SIGKILL)
    await stream.close()
    other_edge = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=30)
    assert (await other_edge.responses.retrieve(first.response.id)).status == "in_progress"
    done = await until_ended(other_edge, first.response.id)
    expected = await expected_output([{"role": "user", "content": "Do not wait for me."}], seed=40, max_tokens=40,
                                     settings=SLOW_SETTINGS)
    assert done.status == "incomplete" and done.output_text == expected.text and done.usage.output_tokens == 40


async def test_an_edge_that_stores_no_responses_serves_each_as_not_stored(stack, api_key):
    """``TOKENBUS_EDGE_STORE_RESPONSES=false``: nothing of a turn is kept at the edge, whatever the
    request says; a background response, which must be stored, is refused."""
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
    finally:
        edge.signal(signal.SIGTERM)
