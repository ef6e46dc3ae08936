"""Acceptance: idempotent retries, resuming a stream on another edge after the first one was
SIGKILLed, and cancelling the generation of a client that went away."""

import asyncio
import base64
import json
import signal
import uuid

import httpx
import openai
import pytest
import redis.asyncio as redis
from aiokafka.partitioner import DefaultPartitioner

from tests.conftest import MODEL, SLOW_MODEL, SLOW_SETTINGS
from tests.expected import expected_output
from tests.gpu_consumers.helpers import read_all, read_written
from tokenbus.infra.devstack.processes import free_port
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, Completion
from tokenbus.sse_edge.plumbing.streams import StreamRegistry
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.sse_edge.state import EdgeState
from tokenbus.topics import TopicCatalog, record_at
from tokenbus.topics.provision import TopicAdmin

CHAT = "/v1/chat/completions"
SSE = {"Accept": "text/event-stream"}  # what SSE clients send; it brings each event's id


def sse_events(text: str) -> list[dict[str, str]]:
    events = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if fields:
            events.append(fields)
    return events


def content_of(events: list[dict[str, str]]) -> str:
    text = ""
    for event in events:
        if event.get("data", "[DONE]") != "[DONE]":
            for choice in json.loads(event["data"]).get("choices", []):
                text += choice["delta"].get("content") or ""
    return text


def completions_in(records: list, request_id: str) -> list[Completion]:
    codec = AvroCodec()
    return [c for c in (codec.decode(r.value, Completion) for r in records) if c.request_id == request_id]


async def completions_for(stack, request_id: str) -> list[Completion]:
    """The request's completions, once at least one is written."""
    bus = stack.bus_settings()
    records = await read_all(bus, TopicCatalog(bus).completions, timeout=15,
                             until=lambda got: bool(completions_in(got, request_id)))
    return completions_in(records, request_id)


async def test_idempotent_retry_is_one_generation_and_one_usage_record(stack, edge_url, api_key):
    client = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "count to three"}]
    retry = {"Idempotency-Key": "order-42-attempt"}
    first, second = await asyncio.gather(*(
        client.chat.completions.create(model=MODEL, messages=messages, seed=4, extra_headers=retry) for _ in range(2)))
    third = await client.chat.completions.create(model=MODEL, messages=messages, seed=4, extra_headers=retry)
    assert first.id == second.id == third.id
    assert first.choices[0].message.content == second.choices[0].message.content == third.choices[0].message.content
    assert await completions_for(stack, first.id)  # the generation's completion, once written
    await asyncio.sleep(1.0)  # a second generation, if there were one, would have finished by now
    bus = stack.bus_settings()
    assert len(completions_in(await read_written(bus, TopicCatalog(bus).completions), first.id)) == 1

    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "other"}],
                                             extra_headers=retry)


async def test_a_streams_record_is_written_before_its_first_chunk_reaches_the_client(stack, edge_url, api_key):
    """The edge records where a stream lives while it publishes the request, not before, but the
    client hears of the stream only once the record is there: from its first chunk on, any edge
    can resume it."""
    connection = redis.Redis.from_url(stack.settings.redis_url)
    registry = StreamRegistry(connection, stack.settings.redis_prefix)
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "where do I live"}]}
    try:
        async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {api_key}"}) as http:
            async with http.stream("POST", f"{edge_url}{CHAT}", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        request_id = json.loads(line.removeprefix("data: "))["id"]
                        break
                record = await registry.get(request_id)  # the stream goes on meanwhile
    finally:
        await connection.aclose()
    assert record is not None
    assert (record.request_id, record.model) == (request_id, MODEL)
    assert record.request_offset >= 0 and record.topic  # where what a continuation repeats is; where the events are


async def test_a_streams_record_names_where_its_request_lies_and_holds_no_prompt(stack, edge_url):
    """A stream record lives in Redis for a day: it names where the request lies on the bus (what
    a continuation repeats) rather than holding it, so no prompt sits in Redis; the request there
    is as the model got it, masked where the tier's policy redacts."""
    key = await stack.create_key(f"tenant-{uuid.uuid4().hex[:8]}", "batch")  # batch redacts e-mail addresses
    answer = await openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Summarise mail from ann@example.com please"}])
    connection = redis.Redis.from_url(stack.settings.redis_url)
    try:
        registry = StreamRegistry(connection, stack.settings.redis_prefix)
        raw = await connection.get(registry._stream(answer.id))
        record = await registry.get(answer.id)
    finally:
        await connection.aclose()
    assert raw is not None and not json.loads(raw)["request"] and len(raw) < 1000  # no request, no prompt
    assert b"Summarise" not in raw and b"example.com" not in raw
    assert record is not None and record.request_topic == TopicCatalog(stack.bus_settings()).requests(MODEL, "batch")
    value = await record_at(stack.bus_settings(), record.request_topic, record.request_partition, record.request_offset)
    assert value is not None
    published = AvroCodec().decode(value, ChatRequest)
    assert published.request_id == answer.id and published.created_at_ms == record.created_at_ms
    assert published.messages[0].content == "Summarise mail from [REDACTED:pii_email] please"


async def test_requests_naming_one_prompt_cache_key_share_a_partition(stack, edge_url):
    """OpenAI's prompt_cache_key, given through the official client to chat completions and to
    Responses, travels on each request and places them on the partition its tenant-scoped key
    hashes to (aiokafka's partitioner), whatever conversation each names; a response repeats it."""
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    client = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=await stack.create_key(tenant, "standard"))
    chats = [await client.chat.completions.create(  # prompts with nothing in common: placed by key alone
        model=MODEL, messages=[{"role": "user", "content": f"{uuid.uuid4().hex} question {i}"}],
        metadata={"conversation_id": f"conversation-{i}"}, prompt_cache_key="agent-7") for i in range(4)]
    turn = await client.responses.create(model=MODEL, input=f"{uuid.uuid4().hex} turn", prompt_cache_key="agent-7")
    assert turn.prompt_cache_key == "agent-7"
    connection = redis.Redis.from_url(stack.settings.redis_url)
    try:
        registry = StreamRegistry(connection, stack.settings.redis_prefix)
        records = [await registry.get(request_id) for request_id in [c.id for c in chats] + [turn.id]]
    finally:
        await connection.aclose()
    assert all(record is not None for record in records)
    published = [AvroCodec().decode(await record_at(stack.bus_settings(), r.request_topic, r.request_partition,
                                                    r.request_offset), ChatRequest) for r in records]
    assert {(p.prompt_cache_key, p.partition_key) for p in published} == {("agent-7", f"{tenant}/agent-7")}
    partitions = list(range(stack.bus_settings().request_partitions))  # as the stack provisioned its topics
    assert {r.request_partition for r in records} == {
        DefaultPartitioner()(f"{tenant}/agent-7".encode(), partitions, partitions)}


async def test_a_record_that_holds_its_request_as_records_once_did_is_still_read(stack):
    """Records an edge wrote before they named the request's place held the request itself (Avro,
    base64); for as long as they last they are read as such."""
    request = ChatRequest("chatcmpl-legacy", MODEL, "standard", [ChatMessage("user", "hello")], "replies", 0,
                          tenant="legacy", created_at_ms=1_700_000_000_000)
    held = {"request_id": request.request_id, "tenant": "legacy", "model": MODEL, "partition": 0, "start_offset": 5,
            "include_usage": False, "body_hash": "", "topic": "",
            "request": base64.b64encode(AvroCodec().encode(request)).decode()}
    connection = redis.Redis.from_url(stack.settings.redis_url)
    try:
        registry = StreamRegistry(connection, stack.settings.redis_prefix)
        await connection.set(registry._stream(request.request_id), json.dumps(held), ex=60)
        record = await registry.get(request.request_id)
    finally:
        await connection.aclose()
    assert record is not None and record.names_request and record.request_offset == -1
    assert await EdgeState(EdgeSettings()).turn_request(record) == request


async def test_a_stream_resumes_on_another_edge_after_the_first_is_killed(stack, edge_url, api_key):
    port = free_port()
    doomed = stack.start_edge("edge-resume", port, reply_partitions="2")
    headers = {"Authorization": f"Bearer {api_key}", **SSE}
    body = {"model": SLOW_MODEL, "stream": True, "seed": 21, "max_tokens": 60,
            "messages": [{"role": "user", "content": "a long story"}]}
    got: list[dict[str, str]] = []
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        async with http.stream("POST", f"http://127.0.0.1:{port}{CHAT}", json=body) as response:
            buffer = ""
            async for chunk in response.aiter_text():
                buffer += chunk
                *complete, buffer = buffer.split("\n\n")
                got += sse_events("\n\n".join(complete))
                if sum(1 for e in got if "id" in e) >= 10:
                    break
        doomed.signal(signal.SIGKILL)
        request_id = json.loads(got[0]["data"])["id"]
        last_id = [e["id"] for e in got if "id" in e][-1]

        resumed = await http.get(f"{edge_url}{CHAT}/{request_id}/stream", headers={"Last-Event-ID": last_id})
        assert resumed.status_code == 200
        rest = sse_events(resumed.text)

        outsider = await stack.create_key("outsider", "standard")
        denied = await http.get(f"{edge_url}{CHAT}/{request_id}/stream", headers={
            "Last-Event-ID": last_id, "Authorization": f"Bearer {outsider}"})
    assert denied.status_code == 404 and denied.json()["error"]["code"] == "stream_not_found"

    expected = await expected_output(body["messages"], seed=21, max_tokens=60, settings=SLOW_SETTINGS)
    assert content_of(got) + content_of(rest) == expected.text
    assert rest[-1]["data"] == "[DONE]"
    ids = [e["id"] for e in got + rest if "id" in e]
    assert len(ids) == len(set(ids)), "an event was delivered twice"
    # On the embedded broker the dead edge wrote to a rolled reply log; the stream record names it.
    connection = redis.Redis.from_url(stack.settings.redis_url)
    try:
        record = await StreamRegistry(connection, stack.settings.redis_prefix).get(request_id)
    finally:
        await connection.aclose()
    assert record is not None and TopicCatalog(stack.bus_settings()).parse_rolled_reply_log(record.topic) is not None


async def test_resuming_after_the_last_event_ends_the_stream_at_once(stack, edge_url, api_key):
    """A client that lost its connection just after the final event resumes from it: it gets
    ``[DONE]`` and nothing else, not a wait for events that will never come."""
    body = {"model": MODEL, "stream": True, "seed": 9, "messages": [{"role": "user", "content": "short one"}]}
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {api_key}", **SSE}) as http:
        whole = sse_events((await http.post(f"{edge_url}{CHAT}", json=body)).text)
        request_id = json.loads(whole[0]["data"])["id"]
        last_id = [e["id"] for e in whole if "id" in e][-1]
        resumed = await http.get(f"{edge_url}{CHAT}/{request_id}/stream", headers={"Last-Event-ID": last_id})
    assert whole[-1]["data"] == "[DONE]" and json.loads(whole[-2]["data"])["choices"][0]["finish_reason"] is not None
    assert resumed.status_code == 200
    assert sse_events(resumed.text) == [{"data": "[DONE]"}]


async def test_a_stream_whose_rolled_log_is_gone_is_expired_at_once(stack, api_key):
    """On the embedded broker an edge deletes a rolled reply log once done with (10 minutes after
    it moved on from it); resuming one of its streams after that is a clear 404 at once, not a
    wait for events that are gone."""
    port = free_port()
    edge = stack.start_edge("edge-expiry", port, reply_partitions="5", env={"TOKENBUS_EDGE_REPLY_ROTATE_S": "0.5"})
    edge_url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "stream": True, "seed": 3, "messages": [{"role": "user", "content": "soon gone"}]}
    try:
        async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {api_key}", **SSE}) as http:
            whole = sse_events((await http.post(f"{edge_url}{CHAT}", json=body)).text)
            request_id = json.loads(whole[0]["data"])["id"]
            kept = await http.get(f"{edge_url}{CHAT}/{request_id}/stream")
            assert kept.status_code == 200 and content_of(sse_events(kept.text)) == content_of(whole)

            connection = redis.Redis.from_url(stack.settings.redis_url)
            try:
                record = await StreamRegistry(connection, stack.settings.redis_prefix).get(request_id)
            finally:
                await connection.aclose()
            await asyncio.sleep(1.5)  # the edge has moved on to newer logs
            admin = TopicAdmin(stack.bus_settings().bootstrap_servers)
            await admin.start()
            try:
                await admin.delete([record.topic])  # what the edge does once the keep time is over
            finally:
                await admin.close()
            expired = await http.get(f"{edge_url}{CHAT}/{request_id}/stream")
    finally:
        edge.stop()
    assert expired.status_code == 404 and expired.json()["error"]["code"] == "stream_expired"


async def test_a_client_that_goes_away_stops_its_generation(stack, edge_url, api_key):
    body = {"model": SLOW_MODEL, "stream": True, "messages": [{"role": "user", "content": "never mind"}]}
    received = 0
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {api_key}"}) as http:
        async with http.stream("POST", f"{edge_url}{CHAT}", json=body) as response:
            buffer = ""
            async for chunk in response.aiter_text():
                buffer += chunk
                events = sse_events(buffer)
                received = len(events) - 1  # content chunks after the role chunk
                if received >= 5:
                    request_id = json.loads(events[0]["data"])["id"]
                    break
    (completion,) = await completions_for(stack, request_id)
    assert completion.cancelled and completion.finish_reason == "cancelled"
    grace_s, step_s = 1.0, 1 / SLOW_SETTINGS.tokens_per_s
    # Generation stopped within the grace window plus one step (and a second of slack for the bus).
    assert completion.completion_tokens <= received + (grace_s + step_s + 1.0) * SLOW_SETTINGS.tokens_per_s
    assert completion.completion_tokens < SLOW_SETTINGS.min_tokens


def naive_chunks(text: str) -> list[dict]:
    """The simplest reader: skip blank lines, strip ``data: ``, parse JSON until [DONE]."""
    chunks = []
    for line in text.splitlines():
        if line:
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    return chunks


def text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_a_plain_client_reads_the_default_stream_and_resumes_by_chunk_count(stack, edge_url, api_key):
    """No ``id:`` lines and no comments by default, so the simplest parser works; such a client
    resumes with the number of chunks it has (``?after_chunks=N``)."""
    body = {"model": SLOW_MODEL, "stream": True, "seed": 33, "max_tokens": 30,
            "messages": [{"role": "user", "content": "plain please"}]}
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {api_key}"}) as http:
        lines: list[str] = []
        async with http.stream("POST", f"{edge_url}{CHAT}", json=body) as response:
            async for line in response.aiter_lines():
                lines.append(line)
                if sum(1 for x in lines if x) >= 8:
                    break  # the connection drops here
        before = naive_chunks("\n".join(lines))
        resumed = await http.get(f"{edge_url}{CHAT}/{before[0]['id']}/stream", params={"after_chunks": len(before)})
        bad = await http.get(f"{edge_url}{CHAT}/{before[0]['id']}/stream", params={"after_chunks": "x"})
    assert len(before) == 8
    assert resumed.status_code == 200 and resumed.text.endswith("data: [DONE]\n\n")
    assert {line.split(":")[0] for line in resumed.text.splitlines() if line} == {"data"}
    expected = await expected_output(body["messages"], seed=33, max_tokens=30, settings=SLOW_SETTINGS)
    assert text_of(before) + text_of(naive_chunks(resumed.text)) == expected.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after_chunks"


async def test_a_retry_after_a_timeout_with_the_same_key_gets_the_same_generation_whole(stack, edge_url):
    """A client whose request timed out (it went away, the generation under way) and who retries
    with the same Idempotency-Key within the grace window gets that generation, whole: it is not
    cancelled, and none is published again."""
    tenant = f"patient-{uuid.uuid4().hex[:8]}"
    body = {"model": SLOW_MODEL, "messages": [{"role": "user", "content": "take your time"}]}
    headers = {"Authorization": f"Bearer {await stack.create_key(tenant, 'standard')}",
               "Idempotency-Key": f"slow-{uuid.uuid4().hex}"}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{edge_url}{CHAT}", json=body, timeout=0.5)
        retried = await http.post(f"{edge_url}{CHAT}", json=body)
    assert retried.status_code == 200, retried.text
    answer = retried.json()
    assert answer["usage"]["completion_tokens"] == SLOW_SETTINGS.max_tokens
    (completion,) = await completions_for(stack, answer["id"])
    assert not completion.cancelled and completion.completion_tokens == SLOW_SETTINGS.max_tokens
    bus = stack.bus_settings()
    codec = AvroCodec()
    written = [codec.decode(r.value, Completion) for r in await read_written(bus, TopicCatalog(bus).completions)]
    assert [c.request_id for c in written if c.tenant == tenant] == [answer["id"]]  # one generation, not two
