"""The batches job against the real Redis: a batch request's Completion becomes its line's
outcome; any other Completion passes by; one that names a batch but no line is dead-lettered."""

import pytest

from tests.stores.test_files_and_batches import completion
from tokenbus.stream_processors.batches import BatchOutcomes
from tokenbus.stream_processors.context import Rejected


async def test_the_job_keeps_batch_outcomes_only_and_rejects_a_batch_request_without_its_line(batch_stores):
    batches, _ = batch_stores
    outcomes = BatchOutcomes(batches)
    kept = completion("batch_" + "2" * 24, 4, text="kept")
    await outcomes.handle(kept, None)
    assert (await batches.outcomes("batch_" + "2" * 24))[4]["text"] == "kept"
    plain = completion("batch_" + "0" * 24, 0)
    plain.annotations = {}
    await outcomes.handle(plain, None)
    broken = completion("batch_" + "1" * 24, 0)
    broken.annotations = {"batch": "batch_" + "1" * 24}
    with pytest.raises(Rejected):
        await outcomes.handle(broken, None)
    assert await batches.outcomes("batch_" + "0" * 24) == {} and await batches.outcomes("batch_" + "1" * 24) == {}
