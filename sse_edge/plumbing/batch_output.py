"""A batch's end: once every request line has an outcome (the batches processor keeps them as
their Completions arrive), or its window has passed, the edge that is asked about it first writes
its output file (the answered lines) and its error file (the rest), in line order, in OpenAI's
shapes, and moves it to ``completed``, ``expired`` or ``cancelled``. Moving to ``finalizing``
first makes one edge do it; a finalizing batch left behind by an edge that stopped is taken up
again after ``STALE_FINALIZING_S``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tokenbus.schemas.request_checks import DEADLINE_PASSED
from tokenbus.sse_edge.plumbing.relay import finish_error
from tokenbus.sse_edge.protocol.batches import BatchLine
from tokenbus.sse_edge.protocol.completion_bodies import completion_body
from tokenbus.stores.batches import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FINALIZING,
    RUNNING,
    Batch,
    BatchStore,
)
from tokenbus.stores.files import PURPOSE_BATCH_OUTPUT, FileStore

STALE_FINALIZING_S = 60
# A request may still be running as its window closes (its deadline only keeps it from starting):
# a batch whose lines are not all answered is finished as expired this long after its window.
EXPIRY_GRACE_S = 600
EXPIRED_LINE = {"code": "batch_expired",
                "message": "This request could not be executed before the completion window expired."}
YIELD_EVERY = 256  # lines written between turns of the event loop
CANCELLED_LINE = {"code": "batch_cancelled", "message": "This request was cancelled with its batch."}


def due(batch: Batch, now: float) -> bool:
    """Is the batch ready to be finished: all answered, its window past, or a finish left behind?"""
    if batch.status == FINALIZING:
        return now - batch.times.get(FINALIZING, 0) > STALE_FINALIZING_S
    return batch.running and (batch.completed + batch.failed >= batch.total or now > batch.expires_at + EXPIRY_GRACE_S)


async def finish(batches: BatchStore, files: FileStore, batch: Batch, input_file: bytes | None) -> Batch:
    """Write the batch's files and end it, unless another edge is doing so; the batch as it is then."""
    if not await batches.move(batch.id, (*RUNNING, FINALIZING) if batch.status == FINALIZING else RUNNING, FINALIZING):
        return await batches.get(batch.tenant, batch.id) or batch
    batch = await batches.get(batch.tenant, batch.id) or batch  # cancelled since it was read?
    outcomes = await batches.outcomes(batch.id)
    custom_ids = custom_ids_of(input_file) if input_file is not None and len(outcomes) < batch.total else {}
    answered: list[str] = []
    failed: list[str] = []
    expired = False
    for line in range(batch.total):
        if line % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)  # the edge's open streams go on while a big batch is written
        outcome = outcomes.get(line)
        expired = expired or outcome is None or outcome["error"] == DEADLINE_PASSED
        written = json.dumps(output_line(batch, line, outcome, custom_ids.get(line, "")), separators=(",", ":"),
                             ensure_ascii=False)
        (answered if outcome is not None and outcome["answered"] else failed).append(written)
    output = await files.create(batch.tenant, PURPOSE_BATCH_OUTPUT, f"{batch.id}_output.jsonl",
                                "".join(f"{line}\n" for line in answered).encode())
    errors = await files.create(batch.tenant, PURPOSE_BATCH_OUTPUT, f"{batch.id}_error.jsonl",
                                "".join(f"{line}\n" for line in failed).encode()) if failed else None
    status = CANCELLED if CANCELLING in batch.times else EXPIRED if expired else COMPLETED
    await batches.move(batch.id, (FINALIZING,), status, output_file_id=output.id,
                       error_file_id=errors.id if errors else "", completed=len(answered), failed=len(failed))
    return await batches.get(batch.tenant, batch.id) or batch


def output_line(batch: Batch, line: int, outcome: dict[str, Any] | None, custom_id: str) -> dict[str, Any]:
    """A line of the output file (an answered request) or of the error file (the rest)."""
    made: dict[str, Any] = {"id": f"batch_req_{batch.id.removeprefix('batch_')}_{line}",
                            "custom_id": outcome["custom_id"] if outcome else custom_id, "response": None, "error": None}
    if outcome is None or outcome["error"] == DEADLINE_PASSED:
        made["error"] = EXPIRED_LINE
        return made
    request_id = outcome["request_id"]
    if not outcome["answered"] and (outcome["cancelled"] or outcome["finish_reason"] == "cancelled"):
        made["error"] = CANCELLED_LINE
        return made
    error = finish_error(outcome["finish_reason"], outcome["error"]) if not outcome["answered"] else None
    if error is not None:
        made["response"] = {"status_code": error.status, "request_id": request_id, "body": error.body()}
        return made
    body = completion_body(request_id, outcome["model"], outcome["text"], outcome["finish_reason"],
                           outcome["prompt_tokens"], outcome["completion_tokens"],
                           [tuple(call) for call in outcome["tool_calls"]], outcome["cached_tokens"],
                           text_completion=batch.endpoint == "/v1/completions", created=outcome["created"])
    made["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return made


def custom_ids_of(input_file: bytes) -> dict[int, str]:
    """Each request line's ``custom_id`` (for the lines that never got an outcome), by line."""
    found: dict[int, str] = {}
    for line, text in enumerate(line for line in input_file.splitlines() if line.strip()):
        try:
            found[line] = BatchLine.model_validate_json(text).custom_id
        except ValueError:
            pass  # it was checked when the batch was made
    return found

