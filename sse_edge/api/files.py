"""OpenAI's Files API, for batches: ``POST /v1/files`` (a multipart upload: ``file`` and
``purpose``, which must be ``batch``), ``GET /v1/files``, ``GET /v1/files/{file_id}``,
``GET /v1/files/{file_id}/content`` and ``DELETE /v1/files/{file_id}``. A batch's output and
error files are read here too (purpose ``batch_output``). The tenant always comes from the key:
another tenant's file is not found, whatever its id."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.errors import InvalidRequest, NotFound
from tokenbus.sse_edge.protocol.batches import file_body, list_body
from tokenbus.sse_edge.protocol.validation import cursor_page, list_order, read_body
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.files import PURPOSE_BATCH, StoredFile
from tokenbus.stores.keys import ApiKey

MULTIPART_OVERHEAD_BYTES = 64 * 1024  # the form's boundaries, headers and purpose around the file


async def upload_file(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    settings = edge.settings
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequest("Upload a file as multipart/form-data, with the fields `file` and `purpose`.",
                             code="invalid_content_type")
    # The whole body, bounded and within its time, before the form is parsed (Starlette's parser
    # would spool a body of any size to disk).
    raw = await read_body(request, settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES, settings.file_body_timeout_s)

    async def body() -> AsyncGenerator[bytes, None]:
        yield raw

    try:
        form = await MultiPartParser(request.headers, body(), max_files=1, max_fields=8).parse()
    except MultiPartException as exc:
        raise InvalidRequest(f"The upload is not a valid form: {exc.message}", code="invalid_multipart") from None
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != PURPOSE_BATCH:
        raise InvalidRequest("The only purpose files are uploaded for here is `batch`.", param="purpose",
                             code="invalid_purpose")
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("The form has no `file`.", param="file", code="missing_file")
    content = await upload.read()
    if len(content) > settings.max_file_bytes:
        raise InvalidRequest(f"The file is larger than {settings.max_file_bytes} bytes.", param="file",
                             code="file_too_large")
    stored = await edge.files.create(key.tenant, PURPOSE_BATCH, upload.filename or "upload.jsonl", content)
    return JSONResponse(file_body(stored))


async def list_files(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    purpose = request.query_params.get("purpose") or None
    files = await edge.files.list(key.tenant, purpose)
    if list_order(request) == "asc":
        files.reverse()
    page, has_more = cursor_page(files, [f.id for f in files], request, default_limit=10_000, max_limit=10_000)
    return JSONResponse(list_body([file_body(f) for f in page], has_more))


async def retrieve_file(request: Request) -> Response:
    edge, _, stored = await tenant_file(request)
    return JSONResponse(file_body(stored))


async def file_content(request: Request) -> Response:
    edge, key, stored = await tenant_file(request)
    content = await edge.files.content(key.tenant, stored.id)
    if content is None:  # deleted or expired meanwhile
        raise file_not_found(stored.id)
    return Response(content, media_type="application/jsonl" if stored.filename.endswith(".jsonl")
                    else "application/octet-stream")


async def delete_file(request: Request) -> Response:
    edge, key, stored = await tenant_file(request)
    await edge.files.delete(key.tenant, stored.id)
    return JSONResponse({"id": stored.id, "object": "file", "deleted": True})


async def tenant_file(request: Request) -> tuple[EdgeState, ApiKey, StoredFile]:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    file_id = request.path_params["file_id"]
    stored = await edge.files.get(key.tenant, file_id)
    if stored is None:
        raise file_not_found(file_id)
    return edge, key, stored


def file_not_found(file_id: str, param: str = "file_id") -> NotFound:
    return NotFound(f"No such File object: {file_id}", param=param, code="file_not_found")
