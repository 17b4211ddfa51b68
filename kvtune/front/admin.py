"""The admin API both servers serve, `GET`/`PATCH /admin/config`: its bearer-token guard and its routes.

Exactly one `Authorization` header, equal to `Bearer <token>` (compared in constant time), or the request is
refused: a request carrying two credentials is ambiguous, and a gateway that adds its own header must not
be overridden by one the client sent, whichever of them a framework happens to read first. Without a token
the routes do not exist at all (404), so a server started without one cannot be retuned by anyone. Unknown
fields and bad values are 400s, and a rejected patch changes nothing. What a server holds and how it
changes it are its own (`read_config`, `apply_patch`); everything else about the routes is here.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from kvtune.contract.admin import ADMIN_CONFIG_PATH
from kvtune.contract.knobs import KNOB_MAX_TOKENS_CAP
from kvtune.front.body import RequestBodyError
from kvtune.front.errors import ApiError, error_body

logger = logging.getLogger(__name__)

P = TypeVar("P", bound=BaseModel)


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


def admin_router(
    token: str | None,
    patch_model: type[P],
    read_config: Callable[[], Awaitable[BaseModel]],
    apply_patch: Callable[[P], Awaitable[BaseModel]],
    read_body: Callable[[Request], Awaitable[Any]],
) -> APIRouter:
    """The admin routes, or an empty router when no token is configured (every admin path is then 404).

    `read_body` reads the request's JSON under the server's body limits; `apply_patch` raises ValueError for
    a value out of bounds (400) and ApiError for anything else it must answer (a dead engine's 503). A field
    the patch model allows to be absent but not null (every one but the cap, whose null removes it) is
    refused as null before anything is applied."""
    router = APIRouter()
    if token is None:
        return router
    expected = f"Bearer {token}".encode()
    nullable = {KNOB_MAX_TOKENS_CAP}

    @router.get(ADMIN_CONFIG_PATH)
    async def get_config(request: Request) -> JSONResponse:
        if (refused := admin_refusal(request, expected)) is not None:
            return refused
        try:
            config = await read_config()
        except ApiError as err:
            return err.response()
        return JSONResponse(config.model_dump())

    @router.patch(ADMIN_CONFIG_PATH)
    async def patch_config(request: Request) -> JSONResponse:
        if (refused := admin_refusal(request, expected)) is not None:
            return refused
        try:
            patch = patch_model.model_validate(await read_body(request))
        except RequestBodyError as err:
            return err.response()
        except (ValueError, ValidationError) as err:
            return JSONResponse(error_body(400, f"invalid admin config: {err}"), status_code=400)
        for name in patch_model.model_fields:
            if name in patch.model_fields_set - nullable and getattr(patch, name) is None:
                return JSONResponse(error_body(400, f"{name} cannot be null"), status_code=400)
        try:
            config = await apply_patch(patch)
        except ValueError as err:
            return JSONResponse(error_body(400, str(err)), status_code=400)
        except ApiError as err:
            return err.response()
        settings = config.model_dump(exclude={"bounds"})
        logger.info("admin: %s", " ".join(f"{name}={value}" for name, value in settings.items()))
        return JSONResponse(config.model_dump())

    return router
