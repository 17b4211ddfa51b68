"""The admin API's bearer-token check, shared by the engine and the proxy (torch-free).

Exactly one `Authorization` header, equal to `Bearer <token>` (compared in constant time), or the request is
refused: a request carrying two credentials is ambiguous, and a gateway that adds its own header must not
be overridden by one the client sent, whichever of them a framework happens to read first.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse

from kvtune.front.errors import error_body


def admin_refusal(request: Request, expected: bytes) -> JSONResponse | None:
    """The answer that refuses `request` (400 for more than one Authorization header, 401 for a missing or
    wrong token), or None when it carries exactly the expected `Bearer <token>`."""
    given = request.headers.getlist("authorization")
    if len(given) > 1:
        message = f"{len(given)} Authorization headers: send exactly one bearer token"
        return JSONResponse(error_body(400, message), status_code=400)
    if given and hmac.compare_digest(given[0].encode("latin-1"), expected):
        return None
    return JSONResponse(
        error_body(401, "a valid admin bearer token is required"),
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )
