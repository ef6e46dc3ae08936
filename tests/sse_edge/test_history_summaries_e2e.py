"""Summaries of the turns server-side history leaves out, through a stack of their own
(TOKENBUS_EDGE_HISTORY_SUMMARIES: SLOW_MODEL summarizes its own conversations, in a window of
300 tokens): once turns are left out the edge asks for a summary on the bus, the transcripts
job stores it, and the next turns carry it before the turns that fit."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import SLOW_MODEL, SLOW_SETTINGS, own_stack
from tokenbus.infra.devstack.stack import EmbeddedStack
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest
from tokenbus.stores.transcripts.sqlite import SqliteTranscriptStore
from tokenbus.topics import TopicCatalog, make_consumer, topic_partitions

SLOW_ENV = {f"TOKENBUS_SIM_{k.upper()}": str(v) for k, v in SLOW_SETTINGS.model_dump().items()}


@pytest.fixture
def isolated(stack: EmbeddedStack, tmp_path: Path) -> Iterator[EmbeddedStack]:
    env = {"TOKENBUS_EDGE_CONTEXT_WINDOWS": f"{SLOW_MODEL}:300",
           "TOKENBUS_EDGE_HISTORY_SUMMARIES": f"{SLOW_MODEL}:{SLOW_MODEL}", "TOKENBUS_EDGE_HISTORY_SUMMARY_MAX_TOKENS": "20"}
    with own_stack(stack, tmp_path / "run", [SLOW_MODEL], env, {SLOW_MODEL: SLOW_ENV}) as own:
        yield own


async def bus_requests(stack: EmbeddedStack, tier: str) -> list[ChatRequest]:
    bus = stack.bus_settings()
    topic = TopicCatalog(bus).requests(SLOW_MODEL, tier)
    codec, found = AvroCodec(), []
    consumer = make_consumer(bus)
    await consumer.start()
    try:
        consumer.assign(await topic_partitions(consumer, topic))
        await consumer.seek_to_beginning()
        while batches := await consumer.getmany(timeout_ms=1000):
            found += [codec.decode(r.value, ChatRequest) for records in batches.values() for r in records]
    finally:
        await consumer.stop()
    return found


async def test_left_out_turns_are_summarized_and_the_summary_goes_first(isolated):
    client = openai.AsyncOpenAI(base_url=f"{isolated.edge_url}/v1", api_key=isolated.dev_key, max_retries=0,
                                timeout=60)
    store = SqliteTranscriptStore(isolated.transcripts_path)
    system = {"role": "system", "content": "You are terse."}
    try:
        summary = None
        for i in range(40):
            metadata = {"conversation_id": "long-talk"} | ({"history": "server"} if i else {})
            user = {"role": "user", "content": f"question {i}: " + "tell me more about the bus " * 2}
            await client.chat.completions.create(model=SLOW_MODEL, messages=[system, user], max_tokens=6,
                                                 metadata=metadata)
            conversation = await store.get_conversation("dev", "long-talk")
            if conversation and conversation.summary:
                summary = conversation.summary
                break
            await asyncio.sleep(0.1)
        assert summary is not None, "no summary was stored"
        last = await client.chat.completions.create(
            model=SLOW_MODEL, messages=[system, {"role": "user", "content": "and finally?"}], max_tokens=6,
            metadata={"conversation_id": "long-talk", "history": "server"})
        rows = (await store.list_messages("dev", "long-talk", 500)).items
    finally:
        await store.close()

    served = {r.request_id: r for r in await bus_requests(isolated, "standard")}
    prompt = served[last.id].messages
    assert prompt[0] == ChatMessage("system", "You are terse.")
    assert prompt[1] == ChatMessage("system", f"Summary of the earlier conversation: {summary.content}")
    kept = prompt[2:-1]
    assert kept and kept[0].role == "user" and prompt[-1].content == "and finally?"
    assert len(kept) // 2 < (len(rows) - 1) // 2  # turns were left out; the summary stands for them

    summarizing = [r for r in await bus_requests(isolated, "batch") if r.annotations.get("purpose") == "summary"]
    assert summarizing and summarizing[0].annotations["conversation_id"] == "long-talk"
    assert summarizing[0].tenant == "dev" and summarizing[0].conversation_id is None
    assert all(r.request_id not in {s.request_id for s in summarizing} for r in rows)  # a summary is no turn
