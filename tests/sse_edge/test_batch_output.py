"""A batch's end, against the real Redis: once its lines are all answered, or its window has
passed with some never answered (their request was never served), one edge writes its output and
error files in line order and ends it. The outcomes are kept by the batches processor's job, as
the stack runs it."""

import json
import time

from tests.stores.test_files_and_batches import completion
from tokenbus.schemas.request_checks import DEADLINE_PASSED
from tokenbus.sse_edge.plumbing import batch_output
from tokenbus.stores.batches import COMPLETED, EXPIRED, FINALIZING, IN_PROGRESS, Batch, batch_outcome, new_batch_id
from tokenbus.stream_processors.batches import BatchOutcomes


def new_batch(total: int, expires_in_s: int = 86_400) -> Batch:
    now = int(time.time())
    return Batch(new_batch_id(), "acme", "/v1/chat/completions", "file-x", "24h", IN_PROGRESS, now - 10,
                 now + expires_in_s, total=total, times={IN_PROGRESS: now - 10})


INPUT = b"".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {}}).encode() + b"\n\n" for i in range(3))  # blank lines between


async def test_an_answered_batch_is_finished_once_with_its_files_in_line_order(batch_stores):
    batches, files = batch_stores
    batch = new_batch(3)
    await batches.create(batch)
    outcomes = BatchOutcomes(batches)
    for line in (2, 0):
        await outcomes.handle(completion(batch.id, line, text=f"answer {line}"), None)
    await outcomes.handle(completion(batch.id, 1, finish_reason="error", error="engine failed"), None)
    await outcomes.handle(completion(batch.id, 1, text="redelivered"), None)  # read again: the first stands
    batch = await batches.get("acme", batch.id)
    assert batch_output.due(batch, time.time())
    done = await batch_output.finish(batches, files, batch, None)
    assert (done.status, done.completed, done.failed) == (COMPLETED, 2, 1)
    output = [json.loads(line) for line in (await files.content("acme", done.output_file_id)).splitlines()]
    assert [(line["custom_id"], line["response"]["body"]["choices"][0]["message"]["content"]) for line in output] == [
        ("req-0", "answer 0"), ("req-2", "answer 2")]
    errors = [json.loads(line) for line in (await files.content("acme", done.error_file_id)).splitlines()]
    assert errors[0]["custom_id"] == "req-1" and errors[0]["response"]["status_code"] == 500
    assert "engine failed" in errors[0]["response"]["body"]["error"]["message"]
    again = await batch_output.finish(batches, files, batch, None)  # a second edge: nothing more written
    assert again.output_file_id == done.output_file_id and len(await files.list("acme")) == 2
    late = completion(batch.id, 1, text="a redelivery after the end")
    assert await batches.record_outcome(batch.id, 1, batch_outcome(late)) is False  # ended: its counts stay
    assert (await batches.get("acme", batch.id)).completed == 2


async def test_a_batch_past_its_window_ends_expired_naming_the_lines_never_answered(batch_stores):
    batches, files = batch_stores
    batch = new_batch(3, expires_in_s=-batch_output.EXPIRY_GRACE_S - 1)
    await batches.create(batch)
    await BatchOutcomes(batches).handle(completion(batch.id, 0), None)
    await BatchOutcomes(batches).handle(completion(batch.id, 1, finish_reason="error", error=DEADLINE_PASSED), None)
    batch = await batches.get("acme", batch.id)
    assert batch_output.due(batch, time.time()) and not batch_output.due(new_batch(3), time.time())
    done = await batch_output.finish(batches, files, batch, INPUT)
    assert (done.status, done.completed, done.failed) == (EXPIRED, 1, 2)
    errors = [json.loads(line) for line in (await files.content("acme", done.error_file_id)).splitlines()]
    assert [(e["custom_id"], e["error"]["code"], e["response"]) for e in errors] == [
        ("req-1", "batch_expired", None), ("req-2", "batch_expired", None)]


async def test_a_finish_left_behind_is_taken_up_once_it_is_stale(batch_stores):
    batches, files = batch_stores
    batch = new_batch(1)
    await batches.create(batch)
    await BatchOutcomes(batches).handle(completion(batch.id, 0), None)
    assert await batches.move(batch.id, (IN_PROGRESS,), FINALIZING)  # an edge began, and stopped
    stuck = await batches.get("acme", batch.id)
    assert not batch_output.due(stuck, time.time())
    assert batch_output.due(stuck, time.time() + batch_output.STALE_FINALIZING_S + 1)
    done = await batch_output.finish(batches, files, stuck, None)
    assert done.status == COMPLETED and done.completed == 1
