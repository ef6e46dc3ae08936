"""A Responses API turn's stream survives what happens to its client and its edge, through the real
embedded stack with the official openai client: read again after any event, on any edge; a
background turn generated without its client; and every stored turn stored as it ended, whether
its client went away for good (stream or whole answer) or its edge was killed (the next edge asked
reads it on from the log once the dead edge's reader lease lapses)."""

import asyncio
import json
import signal
import uuid

import httpx
import openai
import pytest

from tests.conftest import MODEL, SLOW_MODEL, SLOW_SETTINGS
from tests.expected import expected_output
from tests.gpu_consumers.helpers import read_written
from tests.sse_edge.responses_helpers import another_edge, until_ended, up_to_the_first_delta
from tests.stream_processors.helpers import eventually
from tokenbus.schemas import AvroCodec, ChatRequest
from tokenbus.stores.redis_client import redis_client
from tokenbus.stores.responses import ResponseStore
from tokenbus.topics import TopicCatalog

pytestmark = pytest.mark.stack

SHORT_LEASE = {"TOKENBUS_EDGE_READER_LEASE_S": "3"}  # an edge to kill: its responses are taken over 3 s after


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


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


async def test_a_retry_after_a_timeout_with_the_same_key_gets_the_same_response_whole(stack, edge_url):
    """A whole answer's client that timed out and retries with the same Idempotency-Key within the
    grace window gets the response its first request made, once it has ended: not cancelled, and
    no second turn published. A retry of a response not stored cannot take it up: it is a new turn."""
    tenant = f"patient-{uuid.uuid4().hex[:8]}"
    headers = {"Authorization": f"Bearer {await stack.create_key(tenant, 'standard')}"}
    body = {"model": SLOW_MODEL, "input": "Take your time.", "max_output_tokens": 120}
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", timeout=30, headers=headers) as http:
        once = {"Idempotency-Key": f"slow-{uuid.uuid4().hex}"}
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/responses", json=body, headers=once, timeout=0.5)
        retried = await http.post("/responses", json=body, headers=once)
        unstored = {"Idempotency-Key": f"slow-{uuid.uuid4().hex}"}
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/responses", json={**body, "store": False}, headers=unstored, timeout=0.5)
        anew = await http.post("/responses", json={**body, "store": False}, headers=unstored)
        deadline = asyncio.get_running_loop().time() + 10
        while anew.status_code == 409 and asyncio.get_running_loop().time() < deadline:
            # Until the edge has seen the first client go (and let go of its key), the key is in
            # use by a turn it cannot hand over: it says "retry shortly", and a client does.
            assert anew.json()["error"]["code"] == "idempotency_key_in_use"
            await asyncio.sleep(0.2)
            anew = await http.post("/responses", json={**body, "store": False}, headers=unstored)
    assert retried.status_code == 200, retried.text
    response = retried.json()
    assert response["status"] == "incomplete" and response["usage"]["output_tokens"] == 120
    assert response["id"] == retried.headers["x-request-id"]
    assert anew.status_code == 200 and anew.json()["id"] != response["id"]
    turns = await published_for(stack, tenant)
    assert turns.count(response["id"]) == 1 and anew.json()["id"] in turns and len(turns) == 3


async def published_for(stack, tenant: str) -> list[str]:
    """The ids of the tenant's turns published to the slow model's requests topic."""
    bus = stack.bus_settings()
    codec = AvroCodec()
    requests = [codec.decode(r.value, ChatRequest)
                for r in await read_written(bus, TopicCatalog(bus).requests(SLOW_MODEL, "standard"))]
    return [r.request_id for r in requests if r.tenant == tenant]


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
