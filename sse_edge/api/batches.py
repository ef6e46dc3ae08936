"""OpenAI's Batch API: ``POST /v1/batches`` (a file of requests, uploaded with purpose ``batch``,
run within ``24h``), ``GET /v1/batches/{batch_id}``, ``GET /v1/batches`` and
``POST /v1/batches/{batch_id}/cancel``.

A batch is the bus's own kind of work: each request line is checked as its endpoint would check
it (a file with a bad line fails whole, naming its lines, and nothing is published), then
published at the batch tier (``TOKENBUS_EDGE_BATCH_TIER``, the lowest by default) as the request
``{batch_id}-{line}``, with the batch in its annotations and its window's end as its deadline. The
GPU consumers serve it after the tiers above it; its Completions are billed like any other; the
batches processor keeps each one's outcome, and the edge asked about the batch once all are in
writes its output and error files (plumbing/batch_output.py). No rate limit or queue-depth limit
applies: the request log is the queue. An edge that stops while it publishes a batch leaves the
rest to the next edge asked about it (``publish_rest``). The tenant always comes from the key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from aiokafka.errors import KafkaError
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.schemas import ChatRequest, group_cancel_id
from tokenbus.sse_edge.api.chat import chat_bus_request, check_model
from tokenbus.sse_edge.api.completions import text_bus_requests
from tokenbus.sse_edge.api.files import file_not_found
from tokenbus.sse_edge.errors import ApiError, Conflict, InvalidRequest, NotFound, Unavailable, from_validation_error
from tokenbus.sse_edge.plumbing import batch_output
from tokenbus.sse_edge.protocol.batches import (
    COMPLETION_WINDOW_S,
    BatchLine,
    CreateBatchRequest,
    batch_body,
    line_error,
    list_body,
)
from tokenbus.sse_edge.protocol.validation import (
    chat_request_of,
    completion_request_of,
    cursor_page,
    json_object,
    parse_body,
    read_body,
)
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.batches import (
    BATCH,
    BATCH_LINE,
    CANCELLING,
    CUSTOM_ID,
    FAILED,
    IN_PROGRESS,
    VALIDATING,
    Batch,
    batch_request_id,
    new_batch_id,
)
from tokenbus.stores.files import PURPOSE_BATCH
from tokenbus.stores.keys import ApiKey

log = logging.getLogger(__name__)

ERRORS_SHOWN = 100  # a failed batch names this many of its bad lines
STALE_PUBLISHING_S = 60  # a batch whose published count has not grown this long: its edge stopped
PUBLISH_WINDOW = 256  # requests in flight to the broker at once while a batch is published
YIELD_EVERY = 32  # lines checked between turns of the event loop (a line takes ~0.1-0.3 ms)
# What a line may not ask: a batch's answer is one whole response a request, as its Completion
# records it (without log probabilities or an echoed prompt).
NOT_IN_A_BATCH = {"stream": "Streaming", "n": "More than one choice", "logprobs": "Log probabilities",
                  "prompt_logprobs": "Prompt log probabilities", "echo": "Echoing the prompt"}


async def create_batch(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    raw = await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s)
    asked = parse_body(json_object(raw), CreateBatchRequest)
    stored = await edge.files.get(key.tenant, asked.input_file_id)
    content = await edge.files.content(key.tenant, asked.input_file_id) if stored else None
    if stored is None or content is None:
        raise file_not_found(asked.input_file_id, "input_file_id")
    if stored.purpose != PURPOSE_BATCH:
        raise InvalidRequest(f"The file {stored.id} was not uploaded for a batch (its purpose is `{stored.purpose}`).",
                             param="input_file_id", code="invalid_file_purpose")
    now = int(time.time())
    batch = Batch(new_batch_id(), key.tenant, asked.endpoint, stored.id, asked.completion_window, VALIDATING, now,
                  now + COMPLETION_WINDOW_S[asked.completion_window], metadata=asked.metadata or {},
                  key_id=key.key_id, published_at_ms=now * 1000)
    requests, errors = await bus_requests(edge, key, batch, content)
    if errors:
        batch.status, batch.times[FAILED], batch.errors = FAILED, now, errors[:ERRORS_SHOWN]
        await edge.batches.create(batch)
        return JSONResponse(batch_body(batch))
    batch.status, batch.times[IN_PROGRESS], batch.total, batch.model = IN_PROGRESS, now, len(requests), requests[0].model
    await edge.batches.create(batch)  # before any request goes out: its outcome may come at once
    try:
        await publish_all(edge, batch.id, requests)
    except KafkaError as exc:
        with contextlib.suppress(KafkaError):  # (the bus may be down: the lines are ended by the window anyway)
            await edge.bus.cancel(group_cancel_id(batch.id), "its batch could not be published")
        await edge.batches.move(batch.id, (IN_PROGRESS,), FAILED, errors=json.dumps(
            [line_error(0, f"The batch could not be published: {type(exc).__name__}.", "service_unavailable")]))
        raise Unavailable(f"The request bus is unavailable: {type(exc).__name__}.", "service_unavailable") from None
    return JSONResponse(batch_body(batch))


async def bus_requests(edge: EdgeState, key: ApiKey, batch: Batch,
                       content: bytes) -> tuple[list[ChatRequest], list[dict[str, Any]]]:
    """The batch's requests, one a line; or what is wrong with its lines."""
    made: list[ChatRequest] = []
    errors: list[dict[str, Any]] = []
    custom_ids: set[str] = set()
    deadline_ms = batch.expires_at * 1000
    tier = edge.settings.batch_requests_tier
    for file_line, text in enumerate(content.splitlines(), start=1):
        if file_line % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # the edge's open streams go on while a big file is read
        if not text.strip():
            continue
        if len(made) + len(errors) >= edge.settings.max_batch_requests:
            errors.append(line_error(file_line, f"A batch may have at most {edge.settings.max_batch_requests} "
                                     "requests.", "too_many_requests"))
            break
        index = len(made) + len(errors)  # the request's line among the file's requests
        try:
            line = BatchLine.model_validate_json(text)
        except ValidationError as exc:
            failed = from_validation_error(exc)
            errors.append(line_error(file_line, failed.message, "invalid_request", failed.param))
            continue
        try:
            request_id = batch_request_id(batch.id, index)
            bus_request = await line_request(edge, key, batch, line, request_id)
        except ApiError as exc:
            errors.append(line_error(file_line, exc.message, exc.code or "invalid_request", exc.param))
            continue
        if line.custom_id in custom_ids:
            errors.append(line_error(file_line, f"The custom_id {line.custom_id!r} is used by an earlier line.",
                                     "duplicate_custom_id", "custom_id"))
            continue
        custom_ids.add(line.custom_id)
        bus_request.tier, bus_request.deadline_ms = tier, deadline_ms
        bus_request.annotations = {**bus_request.annotations, BATCH: batch.id, BATCH_LINE: str(index),
                                   CUSTOM_ID: line.custom_id}
        made.append(bus_request)
    if not made and not errors:
        errors.append(line_error(0, "The file has no requests.", "empty_file"))
    return made, errors


async def line_request(edge: EdgeState, key: ApiKey, batch: Batch, line: BatchLine, request_id: str) -> ChatRequest:
    """A line's request, checked as its endpoint checks one (an ``ApiError`` says what is wrong)."""
    if line.url != batch.endpoint:
        raise InvalidRequest(f"The line's url {line.url!r} is not the batch's endpoint {batch.endpoint!r}.",
                             param="url", code="invalid_url")
    for name, what in NOT_IN_A_BATCH.items():
        if asks(name, line.body.get(name)):
            raise InvalidRequest(f"{what} cannot be asked in a batch.", param=f"body.{name}", code="invalid_value")
    if batch.endpoint == "/v1/completions":
        completion = completion_request_of(line.body, edge.settings)
        check_model(edge, key, completion.model)
        prompts = await text_bus_requests(completion, edge, key, request_id)
        if len(prompts) > 1:
            raise InvalidRequest("A batch's line has one prompt.", param="body.prompt", code="invalid_value")
        return prompts[0]
    chat = chat_request_of(line.body, edge.settings)
    check_model(edge, key, chat.model)
    if chat.conversation_id is not None:
        raise InvalidRequest("A batch's requests cannot belong to a conversation.",
                             param="body.metadata.conversation_id", code="invalid_value")
    return (await chat_bus_request(chat, edge, key, request_id))[0]


def asks(name: str, value: object) -> bool:
    """Does a body's ``name`` ask for something other than its default?"""
    if value is None or value is False:
        return False
    return value != 1 if name == "n" else True


async def publish_all(edge: EdgeState, batch_id: str, requests: list[ChatRequest], start: int = 0) -> None:
    """Publish the batch's requests from ``start`` on, a window at a time, saying after each how
    many are out (so that another edge can go on from there should this one stop)."""
    ingress = edge.bus.catalog.ingress if edge.settings.route == "ingress" else None
    for first in range(start, len(requests), PUBLISH_WINDOW):
        window = requests[first:first + PUBLISH_WINDOW]
        await asyncio.gather(*(edge.bus.publish(r, topic=ingress) for r in window))
        await edge.batches.published(batch_id, first + len(window))


async def publish_rest(edge: EdgeState, batch: Batch) -> None:
    """Go on publishing a batch whose edge stopped halfway (its published count stale), from that
    count: its requests are made again from its file, with the same ids. The window the stopped
    edge had in flight may go out twice; the pipeline is idempotent by request id (a line keeps
    its first outcome, billing and transcripts count a request once). A key revoked since, or a
    file deleted, leaves the rest unpublished: those lines expire with the batch."""
    if not await edge.batches.take_over_publishing(batch):
        return  # another edge has it
    key = await edge.keys.get(batch.key_id)
    content = await edge.files.content(batch.tenant, batch.input_file_id)
    if key is None or key.revoked or content is None:
        return
    requests, errors = await bus_requests(edge, key, batch, content)
    if errors or len(requests) != batch.total:  # the edge's settings changed since: not the batch it was
        log.warning("batch %s: %d lines no longer pass; they stay unpublished", batch.id, len(errors))
        return
    try:
        await publish_all(edge, batch.id, requests, start=batch.published)
    except KafkaError as exc:  # it is stale again in a minute, and the next edge asked tries
        log.warning("batch %s: publishing the rest failed: %s", batch.id, type(exc).__name__)


async def retrieve_batch(request: Request) -> Response:
    edge, _, batch = await tenant_batch(request)
    return JSONResponse(batch_body(batch))


async def list_batches(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    batches = await edge.batches.list(key.tenant)
    page, has_more = cursor_page(batches, [b.id for b in batches], request, default_limit=20, max_limit=100)
    return JSONResponse(list_body([batch_body(await finished(edge, b)) for b in page], has_more))


async def cancel_batch(request: Request) -> Response:
    """Cancel what has not run: the batch is ``cancelling`` until each of its requests has ended
    (a running one within an engine step), then ``cancelled``, with what was answered in its
    output file."""
    edge, key, batch = await tenant_batch(request)
    if not await edge.batches.move(batch.id, (IN_PROGRESS,), CANCELLING):
        if batch.status == CANCELLING:
            return JSONResponse(batch_body(batch))
        raise Conflict(f"A batch that is {batch.status} cannot be cancelled.", code="batch_not_cancellable")
    # One record for all its requests (``{batch_id}-*``): the running ones stop, the queued ones
    # are answered cancelled, and those fetched later are, by every GPU consumer running now.
    await edge.bus.cancel(group_cancel_id(batch.id), "cancelled with its batch")
    return JSONResponse(batch_body(await finished(edge, await edge.batches.get(key.tenant, batch.id) or batch)))


async def tenant_batch(request: Request) -> tuple[EdgeState, ApiKey, Batch]:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    batch_id = request.path_params["batch_id"]
    batch = await edge.batches.get(key.tenant, batch_id)
    if batch is None:
        raise NotFound(f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
    return edge, key, await finished(edge, batch)


async def finished(edge: EdgeState, batch: Batch) -> Batch:
    """The batch, finished first if it is due (plumbing/batch_output.py); one whose edge stopped
    publishing it goes on being published meanwhile."""
    now = time.time()
    stalled = now - batch.published_at_ms / 1000 > STALE_PUBLISHING_S
    if batch.status == IN_PROGRESS and batch.published < batch.total and stalled:
        edge.in_background(publish_rest(edge, batch))
    if not batch_output.due(batch, now):
        return batch
    needs_input = batch.completed + batch.failed < batch.total  # lines never answered: their custom_id
    content = await edge.files.content(batch.tenant, batch.input_file_id) if needs_input else None
    return await batch_output.finish(edge.batches, edge.files, batch, content)

