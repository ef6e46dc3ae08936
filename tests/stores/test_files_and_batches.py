"""The file and batch stores against the real Redis (one server, and a three-primary Redis
Cluster, where a batch's two keys must share a shard for its scripts): tenants see only their
own, an outcome counts once however often its Completion is read, a status moves only from
where it may."""

import time

from tokenbus.schemas import ChatMessage, ChatRequest, Completion, ToolCall
from tokenbus.stores.batches import (
    BATCH,
    BATCH_LINE,
    CANCELLING,
    COMPLETED,
    CUSTOM_ID,
    FINALIZING,
    IN_PROGRESS,
    RUNNING,
    Batch,
    BatchStore,
    batch_outcome,
    batch_request_id,
    may_be_batch_request,
    new_batch_id,
)
from tokenbus.stores.files import PURPOSE_BATCH, FileStore


def completion(batch_id: str, line: int, **outcome) -> Completion:
    request = ChatRequest(f"{batch_id}-{line}", "m", "batch", [ChatMessage("user", "hi")], "tokens", 0, tenant="acme",
                          annotations={BATCH: batch_id, BATCH_LINE: str(line), CUSTOM_ID: f"req-{line}"})
    made = dict(text="hello", finish_reason="stop", prompt_tokens=5, completion_tokens=2, started_at_ms=0,
                finished_at_ms=0)
    return Completion.for_request(request, **{**made, **outcome})


async def test_files_are_read_back_by_their_tenant_only_newest_first(each_redis):
    client, prefix = each_redis
    files = FileStore(client, prefix, ttl_s=60)
    first = await files.create("acme", PURPOSE_BATCH, "a.jsonl", b'{"a": 1}\n')
    second = await files.create("acme", PURPOSE_BATCH, "b.jsonl", b"")
    await files.create("other", PURPOSE_BATCH, "c.jsonl", b"x")
    assert await files.content("acme", first.id) == b'{"a": 1}\n' and first.bytes == 9
    assert await files.get("other", first.id) is None and await files.content("other", first.id) is None
    assert [f.id for f in await files.list("acme")] == [second.id, first.id]  # made within a second: still in order
    assert await files.delete("other", first.id) is False  # not its file
    assert await files.delete("acme", first.id) is True
    assert await files.get("acme", first.id) is None and [f.id for f in await files.list("acme")] == [second.id]
    assert await files.get("acme", "file-../../etc") is None


async def test_an_outcome_counts_once_however_often_its_completion_is_read(each_redis):
    client, prefix = each_redis
    batches = BatchStore(client, prefix, ttl_s=60)
    now = int(time.time())
    batch = Batch(new_batch_id(), "acme", "/v1/chat/completions", "file-x", "24h", IN_PROGRESS, now, now + 86_400,
                  total=3, metadata={"job": "nightly"}, times={IN_PROGRESS: now})
    await batches.create(batch)
    answered = batch_outcome(completion(batch.id, 0, tool_calls=[ToolCall("call_1", "f", "{}")]))
    failed = batch_outcome(completion(batch.id, 1, finish_reason="error", error="engine failed"))
    assert answered["answered"] and answered["custom_id"] == "req-0" and answered["tool_calls"] == [["call_1", "f", "{}"]]
    assert not failed["answered"]
    assert await batches.record_outcome(batch.id, 0, answered) is True
    assert await batches.record_outcome(batch.id, 0, answered) is False  # read again: not counted again
    assert await batches.record_outcome(batch.id, 1, failed) is True
    stored = await batches.get("acme", batch.id)
    assert (stored.completed, stored.failed, stored.total) == (1, 1, 3)
    assert (stored.input_tokens, stored.output_tokens) == (10, 4)  # 5 and 2 each, the repeat not counted
    assert stored.metadata == {"job": "nightly"} and stored.times == {IN_PROGRESS: now}
    assert (await batches.outcomes(batch.id))[1]["error"] == "engine failed"
    assert set(await batches.outcomes(batch.id)) == {0, 1}
    assert await batches.get("other", batch.id) is None
    assert [b.id for b in await batches.list("acme")] == [batch.id] and await batches.list("other") == []


async def test_a_status_moves_only_from_where_it_may(each_redis):
    client, prefix = each_redis
    batches = BatchStore(client, prefix, ttl_s=60)
    now = int(time.time())
    batch = Batch(new_batch_id(), "acme", "/v1/completions", "file-x", "24h", IN_PROGRESS, now, now + 86_400, total=1)
    await batches.create(batch)
    assert await batches.move(batch.id, (IN_PROGRESS,), CANCELLING) is True
    assert await batches.move(batch.id, (IN_PROGRESS,), CANCELLING) is False  # it is not in progress now
    assert await batches.move(batch.id, RUNNING, FINALIZING) is True
    assert await batches.move(batch.id, RUNNING, FINALIZING) is False  # a second edge does not finish it too
    assert await batches.move(batch.id, (FINALIZING,), COMPLETED, output_file_id="file-y", completed=1) is True
    stored = await batches.get("acme", batch.id)
    assert stored.status == COMPLETED and stored.output_file_id == "file-y" and stored.completed == 1
    assert set(stored.times) == {CANCELLING, FINALIZING, COMPLETED}
    assert await batches.move(new_batch_id(), RUNNING, FINALIZING) is False  # no such batch


async def test_batches_list_newest_first_even_within_one_second(each_redis):
    client, prefix = each_redis
    batches = BatchStore(client, prefix, ttl_s=60)
    now = int(time.time())
    made = [Batch(new_batch_id(), "acme", "/v1/completions", "file-x", "24h", IN_PROGRESS, now, now + 86_400)
            for _ in range(5)]
    for batch in made:
        await batches.create(batch)
    assert [b.id for b in await batches.list("acme")] == [b.id for b in reversed(made)]


async def test_one_caller_takes_over_a_stalled_publishing(each_redis):
    client, prefix = each_redis
    batches = BatchStore(client, prefix, ttl_s=60)
    now = int(time.time())
    batch = Batch(new_batch_id(), "acme", "/v1/completions", "file-x", "24h", IN_PROGRESS, now - 120, now + 86_400,
                  total=600, key_id="k", published_at_ms=(now - 120) * 1000)
    await batches.create(batch)
    await batches.published(batch.id, 256)
    assert await batches.take_over_publishing(batch) is False  # it moved since it was read: its edge is alive
    moved = await batches.get("acme", batch.id)
    assert (moved.published, moved.key_id) == (256, "k") and moved.published_at_ms >= now * 1000
    assert await batches.take_over_publishing(moved) is True
    assert await batches.take_over_publishing(moved) is False  # a second edge, with the same stale read


def test_only_a_batch_request_s_key_is_read_as_one_before_decoding():
    batch_id = new_batch_id()
    assert may_be_batch_request(batch_request_id(batch_id, 7).encode())
    assert not may_be_batch_request(b"chatcmpl-abc") and not may_be_batch_request(b"cmpl-abc-0")
    assert not may_be_batch_request(None)
