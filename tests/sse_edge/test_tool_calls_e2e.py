"""Acceptance: function calling with the official openai client, through the real embedded stack
(edge -> tansu -> GPU consumer, whose simulated engine calls the offered tools -> tansu -> edge)."""

import json
import re

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.expected import expected_calls
from tokenbus.schemas import ToolSpec

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo, and the time there?"}]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def specs(*tools) -> list[ToolSpec]:
    return [ToolSpec(t["function"]["name"], t["function"].get("description", ""),
                     json.dumps(t["function"].get("parameters", {"type": "object", "properties": {}}),
                                separators=(",", ":"))) for t in tools]


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


async def stream_turn(client, messages, **options):
    """One streamed turn, accumulated as OpenAI's docs show: text, calls by index, finish reason."""
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True, **options)
    text, calls, finishes, fragments = "", {}, [], {}
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls, "a call's id and name come once, in its first chunk"
                assert call.type == "function" and call.function.arguments == ""
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
            fragments[call.index] = fragments.get(call.index, 0) + 1
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return text, [calls[i] for i in sorted(calls)], finishes, fragments


async def test_two_step_tool_loop_streaming(client):
    messages = list(QUESTION)
    text, calls, finishes, fragments = await stream_turn(client, messages, tools=[WEATHER], seed=11,
                                                         parallel_tool_calls=False)
    expected = await expected_calls(messages, specs(WEATHER), seed=11, parallel=False)
    assert finishes == ["tool_calls"] and text == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected
    assert CALL_ID.fullmatch(calls[0]["id"])
    assert fragments[0] > 2, "the arguments arrive in pieces"

    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]}]
    messages += [{"role": "tool", "tool_call_id": calls[0]["id"], "content": "3 C and rain"}]
    text, calls, finishes, _ = await stream_turn(client, messages, tools=[WEATHER], seed=11)
    assert calls == [] and text and finishes == ["stop"]  # after the tool's result it answers in words


async def test_two_step_tool_loop_non_streaming(client):
    messages = list(QUESTION)
    first = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], seed=12)
    choice = first.choices[0]
    expected = await expected_calls(messages, specs(WEATHER, TIME), seed=12)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == expected
    assert first.usage.completion_tokens > 0  # the calls were generated, and are billed

    messages.append(choice.message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": f"result of {c.function.name}"}
                 for c in choice.message.tool_calls]
    second = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], seed=12)
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
    assert second.choices[0].message.tool_calls is None


async def test_parallel_tool_calls(client):
    _, calls, finishes, _ = await stream_turn(client, QUESTION, tools=[WEATHER, TIME], seed=13)
    assert [c["name"] for c in calls] == ["get_weather", "get_time"] and finishes == ["tool_calls"]
    assert len({c["id"] for c in calls}) == 2
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == await expected_calls(
        QUESTION, specs(WEATHER, TIME), seed=13)


async def test_tool_choice_none_answers_in_words(client):
    text, calls, finishes, _ = await stream_turn(client, QUESTION, tools=[WEATHER, TIME], tool_choice="none")
    assert calls == [] and text and finishes == ["stop"]


async def test_a_named_tool_choice_forces_that_function(client):
    choice = {"type": "function", "function": {"name": "noop"}}
    completion = await client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME, NOOP],
                                                      tool_choice=choice)
    calls = completion.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [("noop", "{}")]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": {"a": {"type": 5}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
async def test_bad_tools_are_refused_naming_the_param(edge_url, auth, body, param):
    request = {"model": MODEL, "messages": QUESTION, **body}
    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        response = await http.post("/v1/chat/completions", json=request, headers=auth)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_tool_calls_are_kept_in_the_transcript(client, edge_url, auth):
    conversation = "tools-transcript-1"
    completion = await client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], seed=14,
                                                      metadata={"conversation_id": conversation})
    call = completion.choices[0].message.tool_calls[0]
    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        for _ in range(100):
            rows = (await http.get(f"/v1/conversations/{conversation}/messages", headers=auth)).json().get("data", [])
            if any(r["role"] == "assistant" for r in rows):
                break
            await __import__("asyncio").sleep(0.1)
    reply = next(r for r in rows if r["role"] == "assistant")
    assert reply["finish_reason"] == "tool_calls"
    assert reply["tool_calls"] == [{"id": call.id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": call.function.arguments}}]


async def test_an_sse_client_resumes_in_the_middle_of_a_call_without_a_gap_or_a_repeat(edge_url, auth):
    """A call's pieces share one token event; each chunk but the last gets its own id (`p-o.k`)."""
    body = {"model": MODEL, "stream": True, "messages": QUESTION, "tools": [WEATHER], "seed": 15,
            "parallel_tool_calls": False}
    sse = {**auth, "Accept": "text/event-stream"}

    def frames(text: str) -> list[tuple[str, str]]:
        out, event_id = [], None
        for line in text.splitlines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                out.append((event_id, line[6:]))
        return out

    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        whole = frames((await http.post("/v1/chat/completions", json=body, headers=sse)).text)
        request_id = json.loads(whole[0][1])["id"]
        pieces = [i for i, (event_id, _) in enumerate(whole) if event_id and "." in event_id]
        assert len(pieces) >= 2, "the call's pieces carry chunk ids"
        cut = pieces[1]  # the client has the header and one piece of the arguments
        rest = frames((await http.get(f"/v1/chat/completions/{request_id}/stream",
                                      headers={**sse, "Last-Event-ID": whole[cut][0]})).text)
    assert rest == whole[cut + 1:]
