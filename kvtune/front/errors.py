"""OpenAI's error shape, `{"error": {...}}`, for every HTTP front (the engine and the proxy), and the
handlers that turn whatever a route raises into it.

Every error a client can provoke leaves as a JSON body with a 4xx status: FastAPI's own 422 for a body it
could not validate becomes a 400, unknown routes a JSON 404. A 500 is left only for a bug in the server, and
even then the body is JSON and the server keeps serving. An error repeats what the client sent only up to a bound (`echoed`), and a whole message is bounded too: a
1 MB model name must not come back as a 1 MB 404.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody is left to read it


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


class ApiError(Exception):
    """An error the client caused or should hear about, sent as an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = error_body(self.status, self.message, self.param, self.code)
        return JSONResponse(body, self.status, headers=self.headers)


def describe_validation_error(errors: Sequence[Any]) -> ApiError:
    """The first problem pydantic (or FastAPI) found, as a one-line 400 naming the field (OpenAI's
    `param`); FastAPI's leading `body` in the location is not a field the client wrote."""
    first = errors[0] if errors else {}
    param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
    message = str(first.get("msg", "invalid request"))
    return ApiError(400, f"{param}: {message}" if param else message, param)


def internal_error(err: Exception) -> JSONResponse:
    """A bug's answer: logged with its traceback, a JSON 500 naming only the exception's type."""
    logger.exception("unexpected error while serving a request")
    return JSONResponse(error_body(500, f"internal error: {type(err).__name__}"), 500)


def install_error_handlers(app: FastAPI) -> None:
    """Every exception a route can raise answered as an OpenAI-style JSON error (see the module's doc)."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return describe_validation_error(err.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(err.status_code, str(err.detail)), err.status_code, headers=err.headers
        )

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception) -> JSONResponse:
        return internal_error(err)
