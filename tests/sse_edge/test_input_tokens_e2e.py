"""``POST /v1/responses/input_tokens`` through the real embedded stack, with the official openai
client: a turn's input counted as the edge counts it (the stack's edge has no tokenizer: the
estimate), every part of it (instructions, input, tools, the chain or conversation it continues),
the same figure the turn is then admitted with; and the errors a client gets for what is refused."""

import uuid

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.sse_edge.test_history_e2e import requests_on_the_bus
from tokenbus.schemas import ToolSpec, estimate_prompt_tokens

pytestmark = pytest.mark.stack

WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


async def test_a_turns_input_is_counted_as_the_turn_is_admitted_with_it(client, stack):
    asked = {"model": MODEL, "instructions": "Be brief.", "input": "What is the weather in Paris?", "tools": [WEATHER]}
    counted = await client.responses.input_tokens.count(**asked)
    assert counted.object == "response.input_tokens"
    tool = ToolSpec.of(WEATHER["name"], WEATHER["description"], WEATHER["parameters"])
    assert counted.input_tokens == estimate_prompt_tokens(["Be brief.", "What is the weather in Paris?", tool.text])
    turn = await client.responses.create(**asked, tool_choice="none", extra_body={"seed": 61})
    published = (await requests_on_the_bus(stack, {turn.id}, MODEL))[turn.id]
    assert published.estimated_prompt_tokens == counted.input_tokens

    # Continuing it: its chain counts too (the turn's input and answer, not its instructions).
    then = await client.responses.input_tokens.count(model=MODEL, input="And tomorrow?", previous_response_id=turn.id)
    assert then.input_tokens == estimate_prompt_tokens(["What is the weather in Paris?", turn.output_text,
                                                        "And tomorrow?"])
    conversation = await client.conversations.create(items=[{"role": "user", "content": "My name is Ada."}])
    inside = await client.responses.input_tokens.count(model=MODEL, input="Hi.", conversation=conversation.id)
    assert inside.input_tokens == estimate_prompt_tokens(["My name is Ada.", "Hi."])


async def test_what_is_refused_gets_an_openai_error_naming_it(client, stack, edge_url, auth):
    other_key = await stack.create_key(f"count-{uuid.uuid4().hex[:6]}", "standard")
    other = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=other_key, max_retries=0, timeout=30)
    theirs = await other.responses.create(model=MODEL, input="Private.", extra_body={"seed": 62})
    refused = [
        (400, "previous_response_id", {"model": MODEL, "input": "x", "previous_response_id": theirs.id}),
        (400, "tools[0].type", {"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}),
        (400, "input[0].type", {"model": MODEL, "input": [{"type": "reasoning"}]}),
        (400, "model", {"input": "x"}),
        (400, "conversation", {"model": MODEL, "input": "x", "previous_response_id": theirs.id,
                               "conversation": "conv_" + "0" * 32}),
        (404, "model", {"model": "no-such-model", "input": "x"}),
    ]
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        for status, param, body in refused:
            answered = await http.post("/responses/input_tokens", json=body)
            assert answered.status_code == status, (param, answered.text)
            assert answered.json()["error"]["param"] == param, answered.text
