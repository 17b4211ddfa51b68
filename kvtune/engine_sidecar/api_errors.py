"""OpenAI's error shape, `{"error": {...}}`, for every HTTP front (the engine and the proxy).

Torch-free on purpose: the proxy in front of vLLM or SGLang imports it without the engine's dependencies.
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


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`{"error": {...}}` as OpenAI sends it, so every client's error handling works unchanged."""
    detail = ErrorDetail(
        message=message, type=ERROR_TYPES.get(status, "invalid_request_error"), param=param, code=code
    )
    return ErrorResponse(error=detail).model_dump()
