"""`tokenbus trace` on a request of the running embedded stack: every stage, in causal order."""

import asyncio

import openai

from tests.conftest import MODEL
from tokenbus.infra.admin.trace import render, trace
from tokenbus.stores.transcripts import TranscriptSettings

CAUSAL = ["edge accepted", "routed record", "consumer admitted", "first token", "last token", "completion"]


async def test_a_turn_is_traced_from_the_edge_to_the_stores(stack, edge_url, api_key):
    client = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)
    response = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "trace me"}],
                                                    metadata={"conversation_id": "traced"})
    transcripts = TranscriptSettings(sqlite_path=stack.transcripts_path)
    for _ in range(60):  # the transcript and the billing row are written after the completion
        stages = await trace(response.id, stack.bus_settings(), transcripts, stack.processors_url)
        named = {s.name: s for s in stages}
        if {"transcript written", "billed"} <= set(named):
            break
        await asyncio.sleep(0.5)
    assert set(CAUSAL) | {"moderation decision (input)", "transcript written", "billed"} <= set(named), render(stages)
    times = [named[name].at_ms for name in CAUSAL]
    assert times == sorted(times), render(stages)
    assert named["completion"].at_ms <= min(named["transcript written"].at_ms, named["billed"].at_ms)
    assert [s.at_ms for s in stages] == sorted(s.at_ms for s in stages)
    assert await trace("chatcmpl-nothing-like-it", stack.bus_settings(), transcripts, stack.processors_url) == []
