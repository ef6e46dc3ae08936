"""The edge's one error vocabulary, in OpenAI's format:
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status and headers to send.

Raise the subclass that says what went wrong (``InvalidRequest``, ``Unavailable``, ...); each
knows its status and type, and ``Unavailable`` its ``Retry-After``. ``ApiError`` itself takes
any status, for the rare one without a class.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis.asyncio as redis
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class ApiError(Exception):
    status: int = 500
    type: str = "invalid_request_error"

    def __init__(
        self,
        status: int | None,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _Fixed(ApiError):
    """An error whose status (and type) the class fixes."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(None, message, None, param, code, headers)


class InvalidRequest(_Fixed):
    status = 400


class Unauthorized(_Fixed):
    status = 401

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message, code=code, headers={"WWW-Authenticate": "Bearer"})


class PermissionDenied(_Fixed):
    status = 403
    type = "permission_error"


class NotFound(_Fixed):
    status = 404


class RequestTimeout(_Fixed):
    """The request body did not arrive in time; the connection is closed."""

    status = 408

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_timeout", headers={"Connection": "close"})


class Conflict(_Fixed):
    status = 409


class PayloadTooLarge(_Fixed):
    status = 413


class RateLimited(ApiError):
    """429, typed by the limit's dimension (``requests`` or ``tokens``) as OpenAI does."""

    def __init__(self, message: str, dimension: str, retry_after_s: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(429, message, dimension, code="rate_limit_exceeded",
                         headers={**(headers or {}), "Retry-After": str(retry_after_s)})


class ClientClosed(_Fixed):
    """The client went away before a non-streaming answer was ready (nginx's 499)."""

    status = 499

    def __init__(self) -> None:
        super().__init__("The client closed the request.", code="client_closed_request")


class ServerError(_Fixed):
    status = 500
    type = "server_error"


class Unavailable(ApiError):
    """503: something the edge depends on does not answer, or a queue is full; retry after a while."""

    def __init__(self, message: str, code: str, retry_after_s: int = 1, *, status: int = 503) -> None:
        super().__init__(status, message, "server_error", code=code, headers={"Retry-After": str(retry_after_s)})


def model_not_found(model: str) -> ApiError:
    return NotFound(f"The model `{model}` does not exist or you do not have access to it.", param="model",
                    code="model_not_found")


# Pydantic names the member of a union that failed inside ``loc`` (``str``,
# ``list[TextContentPart]``, ``function-after[...]``); those are not parameters.
_UNION_MEMBER_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*|function-.*)$")


def _param_path(loc: tuple[int | str, ...]) -> str:
    """Pydantic's ``('messages', 0, 'content')`` as OpenAI writes it: ``messages[0].content``."""
    path = ""
    for part in loc:
        if isinstance(part, str) and _UNION_MEMBER_TAG.match(part):
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


# Pydantic's error types for a value over its length limit: what OpenAI calls the value, and its code.
LENGTH_LIMITS = {"string_too_long": ("string", "a string", "string_above_max_length"),
                 "too_long": ("array", "an array", "array_above_max_length")}


def from_validation_error(exc: ValidationError, within: tuple[int | str, ...] = ()) -> ApiError:
    """Pydantic's error as OpenAI's, naming the parameter; ``within``: where in the request the
    value validated lies (``("input", 3)``), where it is a part of it."""
    # Of a union's alternatives, the error that got furthest into the value says most.
    errors = exc.errors(include_url=False)
    first = max(errors, key=lambda e: len(_param_path(tuple(e["loc"]))))
    param = _param_path((*within, *first["loc"])) or None
    kind = first["type"]
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
        code = "missing_required_parameter"
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        code = "unknown_parameter"
    elif kind in LENGTH_LIMITS:  # OpenAI's words, which clients (and their authors) look for
        what, a_what, code = LENGTH_LIMITS[kind]
        limit, given = first.get("ctx", {}).get("max_length"), first.get("input")
        message = (f"Invalid '{param}': {what} too long. Expected {a_what} with maximum length {limit}, but got "
                   f"{a_what} with length {len(given) if hasattr(given, '__len__') else '?'} instead.")
    else:
        message = f"Invalid value for '{param}': {first['msg']}."
        code = "invalid_type" if kind.endswith("_type") or kind.endswith("parsing") else "invalid_value"
    return InvalidRequest(message, param=param, code=code)


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def not_found(request: Request, exc: Exception) -> Response:
    return NotFound(f"Unknown path {request.url.path}.", code="not_found").response()


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return ApiError(405, f"Method {request.method} is not allowed on {request.url.path}.",
                    code="method_not_allowed").response()


async def server_error(request: Request, exc: Exception) -> Response:
    return ServerError("The server had an error while processing your request.", code="internal_error").response()


HANDLERS = {ApiError: handle_api_error, 404: not_found, 405: method_not_allowed, 500: server_error}


Result = TypeVar("Result")


async def unless_store_down(operation: Awaitable[Result], what: str, code: str) -> Result:
    """A store operation, answered as unavailable while Redis is (``what`` is: ``Conversations``)."""
    try:
        return await operation
    except (redis.RedisError, OSError):
        raise Unavailable(f"{what} are unavailable right now; retry shortly.", code) from None
