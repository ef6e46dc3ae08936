"""Keeping a stored chat completion, against the real Redis: a stream's events pass by unchanged
and the completion they join up to is kept once the last has gone; a stream that ends in an error,
or whose reader stops first, keeps nothing; a store that is away costs the keeping, not the answer."""

import json
import uuid

from tokenbus.schemas import TokenEvent
from tokenbus.sse_edge.plumbing.kept_completions import KeptCompletion
from tokenbus.sse_edge.plumbing.relay import Choices
from tokenbus.stores.chat_completions import CompletionStore
from tokenbus.stores.redis_client import redis_client
from tokenbus.topics import ReplyEvent


def events_of(request_id: str, texts: list[str], finish_reason: str = "stop", error: str | None = None) -> list:
    made = [ReplyEvent(TokenEvent(request_id, seq, text), 0, seq) for seq, text in enumerate(texts)]
    made.append(ReplyEvent(TokenEvent(request_id, len(texts), "", finish_reason=finish_reason, error=error,
                                      prompt_tokens=7, completion_tokens=len(texts)), 0, len(texts)))
    return made


async def generated(events: list):
    for event in events:
        yield event


def kept_in(store: CompletionStore, completion_id: str) -> KeptCompletion:
    return KeptCompletion(store, "acme", completion_id, 1_700_000_000_000, {"topic": "t"}, "[]")


async def test_a_streams_events_pass_by_and_the_completion_they_make_is_kept():
    client = redis_client("redis://127.0.0.1:6379/0")
    store = CompletionStore(client, f"test-{uuid.uuid4().hex[:8]}:", ttl_s=60)
    try:
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        events = events_of(completion_id, ["Hel", "lo"])
        passed = [e async for e in kept_in(store, completion_id).reading(generated(events), Choices(completion_id), "m")]
        assert passed == events
        stored = await store.get("acme", completion_id)
        assert stored is not None and stored.metadata == {"topic": "t"} and stored.model == "m"
        body = json.loads(stored.body)
        assert body["created"] == 1_700_000_000 and body["choices"][0]["message"]["content"] == "Hello"
        assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 2

        failed_id = f"chatcmpl-{uuid.uuid4().hex}"
        failed = events_of(failed_id, ["x"], finish_reason="error", error="engine died")
        assert len([e async for e in kept_in(store, failed_id).reading(generated(failed), Choices(failed_id), "m")]) == 2
        left_id = f"chatcmpl-{uuid.uuid4().hex}"
        reading = kept_in(store, left_id).reading(generated(events_of(left_id, ["a", "b"])), Choices(left_id), "m")
        await anext(reading)
        await reading.aclose()  # the client went
        assert await store.get("acme", failed_id) is None and await store.get("acme", left_id) is None
    finally:
        await client.aclose()


async def test_a_store_that_is_away_costs_the_keeping_not_the_answer(caplog):
    client = redis_client("redis://127.0.0.1:1/0")  # nothing listens there
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    events = events_of(completion_id, ["ok"])
    try:
        kept = kept_in(CompletionStore(client, "x:"), completion_id)
        assert [e async for e in kept.reading(generated(events), Choices(completion_id), "m")] == events
    finally:
        await client.aclose()
    assert f"completion {completion_id} not stored" in caplog.text
