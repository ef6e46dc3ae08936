"""vLLM's chat template extensions through the real embedded stack with the official openai
package (``extra_body``, as vLLM's clients send them): a reply the client began (the final
assistant message left open, ``continue_final_message``) is continued, and with ``echo`` given back
whole, streamed and not. The stack's simulated engine goes on after such a message with a space,
where a new reply starts without one."""

import openai
import pytest

from tests.conftest import MODEL
from tests.expected import expected_output

BEGUN = [{"role": "user", "content": "What does the bus do?"}, {"role": "assistant", "content": "The bus"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


async def test_a_begun_reply_is_continued_and_echoed_whole_streamed_or_not(client):
    reply = await client.chat.completions.create(model=MODEL, messages=BEGUN, seed=61, max_tokens=6,
                                                 extra_body=CONTINUE)
    echoed = await client.chat.completions.create(model=MODEL, messages=BEGUN, seed=61, max_tokens=6,
                                                  extra_body={**CONTINUE, "echo": True})
    stream = await client.chat.completions.create(model=MODEL, messages=BEGUN, seed=61, max_tokens=6, stream=True,
                                                  extra_body={**CONTINUE, "echo": True})
    pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    fresh = await client.chat.completions.create(model=MODEL, messages=BEGUN, seed=61, max_tokens=6)
    continued = reply.choices[0].message.content
    assert continued.startswith(" ") and not fresh.choices[0].message.content.startswith(" ")
    assert continued.split() == fresh.choices[0].message.content.split()  # the same draws, on after the message
    assert echoed.choices[0].message.content == "The bus" + continued
    assert pieces[0].startswith("The bus") and "".join(pieces) == "The bus" + continued
    assert echoed.usage == reply.usage  # the echo is not generated


async def test_an_echo_gives_back_nothing_where_the_final_message_is_not_the_assistant_s(client):
    messages = [{"role": "user", "content": "Echo nothing of me."}]
    want = await expected_output(messages, seed=62, max_tokens=5)
    echoed = await client.chat.completions.create(model=MODEL, messages=messages, seed=62, max_tokens=5,
                                                  extra_body={"echo": True})
    assert echoed.choices[0].message.content == want.text


async def test_continuing_with_a_generation_prompt_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=BEGUN, extra_body={"continue_final_message": True})
    assert exc.value.param == "continue_final_message" and "add_generation_prompt" in exc.value.message
