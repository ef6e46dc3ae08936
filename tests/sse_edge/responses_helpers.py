"""What the Responses API's and the Conversations API's end-to-end tests share: another edge to
kill or set up otherwise, a stream read to its first delta, a response polled until it ends."""

import asyncio

import openai

from tokenbus.infra.devstack.processes import free_port


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


async def until_ended(client, response_id):
    for _ in range(400):
        response = await client.responses.retrieve(response_id)
        if response.status != "in_progress":
            return response
        await asyncio.sleep(0.05)
    raise AssertionError(f"{response_id} is still in progress")
