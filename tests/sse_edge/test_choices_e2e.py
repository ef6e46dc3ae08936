"""Responses of several choices through the real embedded stack, with the official openai
client: OpenAI's ``n`` for chats and text completions, and a text completion's batch of prompts.
Each choice is a request of its own on the bus, so each is exactly what the engine answers its
prompt with the next seed; the response reads them as one stream, resumable as one."""

import asyncio
import json

import httpx
import openai
import pytest

from tests.conftest import MODEL, SLOW_MODEL, SLOW_SETTINGS
from tests.expected import expected_output
from tests.sse_edge.test_streams_e2e import SSE, completions_for, sse_events

RIVERS = [{"role": "user", "content": "name three rivers"}]
PROMPTS = ["Once upon a time the bus carried", "The consumer read the partition"]


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def texts_by_choice(chunks: list) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if chunk.object == "text_completion" else choice.delta.content
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
    return texts


def data_texts(events: list[dict[str, str]]) -> dict[int, str]:
    """Each choice's content in an SSE stream's events, read as the client reads them."""
    texts: dict[int, str] = {}
    for event in events:
        if event.get("data", "[DONE]") != "[DONE]":
            for choice in json.loads(event["data"])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    return texts


async def test_n_chat_choices_are_the_engine_s_answers_with_successive_seeds_and_the_prompt_counts_once(client):
    wants = [await expected_output(RIVERS, seed=10 + j, max_tokens=30) for j in range(3)]
    plain = await client.chat.completions.create(model=MODEL, messages=RIVERS, seed=10, max_tokens=30, n=3)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    assert [(c.message.content, c.finish_reason) for c in plain.choices] == [(w.text, w.finish_reason) for w in wants]
    assert len({w.text for w in wants}) == 3  # sampled apart
    assert plain.usage.prompt_tokens == wants[0].prompt_tokens  # one prompt, as OpenAI counts it
    assert plain.usage.completion_tokens == sum(w.completion_tokens for w in wants)

    stream = await client.chat.completions.create(model=MODEL, messages=RIVERS, seed=10, max_tokens=30, n=3,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert texts_by_choice(chunks) == {j: w.text for j, w in enumerate(wants)}
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finishes == {j: w.finish_reason for j, w in enumerate(wants)}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()


async def test_a_batch_of_prompts_has_n_choices_each_numbered_prompt_by_prompt(client):
    completion = await client.completions.create(model=MODEL, prompt=PROMPTS, n=2, seed=5, max_tokens=20, echo=True)
    wants = [await expected_output([{"role": "user", "content": PROMPTS[i // 2]}], seed=5 + i % 2, max_tokens=20,
                                   text_prompt=True) for i in range(4)]
    assert completion.object == "text_completion" and [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.text for c in completion.choices] == [PROMPTS[i // 2] + w.text for i, w in enumerate(wants)]
    assert completion.usage.prompt_tokens == wants[0].prompt_tokens + wants[2].prompt_tokens
    assert completion.usage.completion_tokens == sum(w.completion_tokens for w in wants)

    stream = await client.completions.create(model=MODEL, prompt=PROMPTS, seed=5, max_tokens=20, stream=True)
    assert texts_by_choice([c async for c in stream]) == {0: wants[0].text, 1: wants[2].text}


async def test_a_stream_of_several_choices_resumes_by_event_id_and_by_count_without_a_gap_or_a_repeat(edge_url,
                                                                                                      auth):
    body = {"model": SLOW_MODEL, "messages": RIVERS, "seed": 3, "max_tokens": 40, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    wants = [await expected_output(RIVERS, seed=3 + j, max_tokens=40, settings=SLOW_SETTINGS) for j in range(3)]
    async with httpx.AsyncClient(base_url=edge_url, timeout=60) as http:
        first: list[dict[str, str]] = []
        async with http.stream("POST", "/v1/chat/completions", json=body, headers={**auth, **SSE}) as response:
            assert response.status_code == 200
            raw = ""
            async for text in response.aiter_text():
                raw += text
                first = sse_events(raw.rsplit("\n\n", 1)[0] + "\n\n")
                if len(first) >= 8:
                    break
        response_id = json.loads(first[0]["data"])["id"]
        ids = [e["id"] for e in first if "id" in e]  # (the role chunks lead, with none)
        assert len(ids) == len(set(ids)) == len(first) - 3
        resumed = await http.get(f"/v1/chat/completions/{response_id}/stream",
                                 headers={**auth, "Last-Event-ID": first[-1]["id"]})
        rest = sse_events(resumed.text)
        assert not {e.get("id") for e in rest} & set(ids)
        together = data_texts(first + rest)
        assert together == {j: w.text for j, w in enumerate(wants)}
        usage = json.loads(rest[-2]["data"])["usage"]
        assert usage["completion_tokens"] == sum(w.completion_tokens for w in wants)
        assert usage["prompt_tokens"] == wants[0].prompt_tokens
        assert rest[-1]["data"] == "[DONE]"

        whole = sse_events((await http.get(f"/v1/chat/completions/{response_id}/stream", headers=auth)).text)
        assert data_texts(whole) == together
        after = sse_events((await http.get(f"/v1/chat/completions/{response_id}/stream?after_chunks=5",
                                           headers=auth)).text)
        assert [e["data"] for e in after] == [e["data"] for e in whole[5:]]


async def test_a_retry_with_the_same_idempotency_key_gets_the_same_choices(client):
    retry = {"Idempotency-Key": "choices-retry-1"}
    first, second = await asyncio.gather(*(client.chat.completions.create(
        model=MODEL, messages=RIVERS, seed=21, max_tokens=20, n=2, extra_headers=retry) for _ in range(2)))
    assert first.id == second.id
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len(first.choices) == 2


async def test_a_response_of_several_choices_is_not_continued(client, edge_url, auth):
    made = await client.chat.completions.create(model=MODEL, messages=RIVERS, seed=1, max_tokens=10, n=2)
    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        response = await http.post(f"/v1/chat/completions/{made.id}/continue", json={}, headers=auth)
    assert response.status_code == 400 and response.json()["error"]["code"] == "several_choices"


async def test_every_choice_stops_when_the_client_goes_away(stack, edge_url, auth):
    body = {"model": SLOW_MODEL, "stream": True, "n": 2, "messages": RIVERS}
    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as response:
            buffer = ""
            async for text in response.aiter_text():
                buffer += text
                if len(events := sse_events(buffer)) >= 6:
                    response_id = json.loads(events[0]["data"])["id"]
                    break
    for index in (0, 1):
        (completion,) = await completions_for(stack, f"{response_id}-{index}")
        assert completion.cancelled and completion.finish_reason == "cancelled"
        assert completion.completion_tokens < SLOW_SETTINGS.min_tokens


async def test_cancelling_a_response_stops_every_choice_and_ends_its_stream(stack, edge_url, auth):
    body = {"model": SLOW_MODEL, "stream": True, "n": 2, "messages": RIVERS}
    chunks = []
    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line.removeprefix("data: ")))
                    if len(chunks) == 6:
                        cancelled = await http.post(f"/v1/chat/completions/{chunks[0]['id']}/cancel", headers=auth)
                        assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
    assert chunks[-1]["error"]["code"] == "generation_cancelled"
    for index in (0, 1):
        (completion,) = await completions_for(stack, f"{chunks[0]['id']}-{index}")
        assert completion.cancelled and completion.completion_tokens < SLOW_SETTINGS.min_tokens
