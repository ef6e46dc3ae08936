"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


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


def from_validation_error(exc: ValidationError) -> ApiError:
    # Of a union's alternatives, the error that got furthest into the value says most.
    errors = exc.errors(include_url=False)
    first = max(errors, key=lambda e: len(_param_path(tuple(e["loc"]))))
    param = _param_path(tuple(first["loc"])) or None
    kind = first["type"]
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
        code = "missing_required_parameter"
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        code = "unknown_parameter"
    else:
        message = f"Invalid value for '{param}': {first['msg']}."
        code = "invalid_type" if kind.endswith("_type") or kind.endswith("parsing") else "invalid_value"
    return ApiError(400, message, param=param, code=code)


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()
