"""OpenAI's error shape, `{"error": {...}}`, for every HTTP front (the engine and the proxy).

Torch-free on purpose: the proxy in front of vLLM or SGLang imports it without the engine's dependencies.

An error repeats what the client sent only up to a bound (`echoed`), and a whole message is bounded too: a
1 MB model name must not come back as a 1 MB 404.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


ECHO_LIMIT = 256  # characters of a client's own value an error message repeats
MESSAGE_LIMIT = 2048  # characters of a whole error message (or param)


def echoed(value: str, limit: int = ECHO_LIMIT) -> str:
    """`value` as an error message repeats it: whole when short, else its start and how much was left out."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value) - limit:,} more characters)"


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`{"error": {...}}` as OpenAI sends it, so every client's error handling works unchanged; the
    message and param bounded (`MESSAGE_LIMIT`), whatever they quote."""
    detail = ErrorDetail(
        message=echoed(message, MESSAGE_LIMIT),
        type=ERROR_TYPES.get(status, "invalid_request_error"),
        param=echoed(param, ECHO_LIMIT) if param is not None else None,
        code=code,
    )
    return ErrorResponse(error=detail).model_dump()
