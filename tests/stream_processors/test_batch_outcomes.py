"""The batches job against the real Redis: a batch request's Completion becomes its line's
outcome while its batch runs; any other Completion passes by; one that names a batch but no line
is dead-lettered."""

import pytest

from tests.sse_edge.test_batch_output import new_batch
from tests.stores.test_files_and_batches import completion
from tokenbus.stores.batches import CANCELLING, COMPLETED, IN_PROGRESS
from tokenbus.stream_processors.batches import BatchOutcomes
from tokenbus.stream_processors.context import Rejected


async def test_the_job_keeps_outcomes_of_running_batches_only(batch_stores):
    batches, _ = batch_stores
    outcomes = BatchOutcomes(batches)
    running, cancelling, ended = new_batch(5), new_batch(5), new_batch(5)
    for batch in (running, cancelling, ended):
        await batches.create(batch)
    await batches.move(cancelling.id, (IN_PROGRESS,), CANCELLING)
    await batches.move(ended.id, (IN_PROGRESS,), COMPLETED)
    for batch in (running, cancelling, ended):
        await outcomes.handle(completion(batch.id, 4, text="kept"), None)
    assert (await batches.outcomes(running.id))[4]["text"] == "kept"
    assert (await batches.outcomes(cancelling.id))[4]["text"] == "kept"  # a running request may still answer
    assert await batches.outcomes(ended.id) == {}
    gone = completion("batch_" + "3" * 24, 0)  # its batch expired from Redis, or never was
    await outcomes.handle(gone, None)
    assert await batches.outcomes("batch_" + "3" * 24) == {}


async def test_other_completions_pass_by_and_a_batch_request_without_its_line_is_rejected(batch_stores):
    batches, _ = batch_stores
    outcomes = BatchOutcomes(batches)
    batch = new_batch(1)
    await batches.create(batch)
    plain = completion(batch.id, 0)
    plain.annotations = {}
    await outcomes.handle(plain, None)
    broken = completion(batch.id, 0)
    broken.annotations = {"batch": batch.id}
    with pytest.raises(Rejected):
        await outcomes.handle(broken, None)
    assert await batches.outcomes(batch.id) == {}
