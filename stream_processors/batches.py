"""The batches job: the Completion of a batch's request (its annotations name the batch and the
line) becomes that line's outcome in the batch store; the edge writes the batch's output once
every line has one. Every other Completion passes by."""

from __future__ import annotations

from typing import Any

from tokenbus.schemas import Completion
from tokenbus.stores.batches import BATCH, BATCH_LINE, BatchStore, batch_outcome
from tokenbus.stream_processors.context import Rejected


class BatchOutcomes:
    name = "batch-outcomes"

    def __init__(self, store: BatchStore) -> None:
        self.store = store

    async def handle(self, completion: Completion, message: Any) -> None:
        batch_id = completion.annotations.get(BATCH)
        if batch_id is None:
            return
        line = completion.annotations.get(BATCH_LINE, "")
        if not line.isdigit():
            raise Rejected("batch_line_missing", f"{completion.request_id} names batch {batch_id} but no line")
        await self.store.record_outcome(batch_id, int(line), batch_outcome(completion))
