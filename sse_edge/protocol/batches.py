"""The bodies of OpenAI's Files and Batch APIs (``/v1/files``, ``/v1/batches``): what a client
asks for a batch, a batch file's request lines, and how files, batches and a batch's output and
error lines are shown, in OpenAI's shapes (the ``openai`` client reads them as its own)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenbus.sse_edge.protocol.metadata import Metadata
from tokenbus.stores.batches import Batch
from tokenbus.stores.files import StoredFile

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOW_S = {"24h": 86_400}  # the one window OpenAI offers
CUSTOM_ID_MAX_CHARS = 512


class CreateBatchRequest(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: Metadata | None = None


class BatchLine(BaseModel):
    """One line of a batch's input file: a request to ``url`` with ``body``, named ``custom_id``
    (unique in the file) so that its answer can be found in the output."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=CUSTOM_ID_MAX_CHARS)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


def line_error(line: int, message: str, code: str = "invalid_request", param: str | None = None) -> dict[str, Any]:
    """One of a failed batch's ``errors`` (``line``: 1-based, as OpenAI counts them)."""
    return {"code": code, "message": message, "param": param, "line": line}


def file_body(stored: StoredFile) -> dict[str, Any]:
    return {"id": stored.id, "object": "file", "bytes": stored.bytes, "created_at": stored.created_at,
            "expires_at": stored.expires_at, "filename": stored.filename, "purpose": stored.purpose,
            "status": "processed", "status_details": None}


def batch_body(batch: Batch) -> dict[str, Any]:
    times = {f"{status}_at": batch.times.get(status) for status in
             ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")}
    return {"id": batch.id, "object": "batch", "endpoint": batch.endpoint,
            "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
            "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
            "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
            "created_at": batch.created_at, "expires_at": batch.expires_at, **times,
            "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
            "metadata": batch.metadata or None, "model": batch.model or None,
            "usage": {"input_tokens": batch.input_tokens, "input_tokens_details": {"cached_tokens": batch.cached_tokens},
                      "output_tokens": batch.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": batch.input_tokens + batch.output_tokens}}


def list_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of OpenAI's cursor lists (``after`` is the last id of the page before)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
