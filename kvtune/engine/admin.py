"""`GET`/`PATCH /admin/config`: the operator's live levers (max_num_seqs, the max_tokens cap and its mode).

Guarded by a bearer token read from a file, so the secret never appears on a command line; a request with
more than one Authorization header is refused (`admin_auth`). Without a token
the routes do not exist at all (404), so an engine started without one cannot be retuned by anyone.
Changes run on the engine thread between steps; lowering max_num_seqs evicts nobody, admission just waits.
Every value has an upper bound the engine itself enforces (`LLMEngine.check_*`): max_num_seqs at most the
pool's blocks, the cap at most max_model_len; `GET` returns the bounds so a client can stay inside them.
"""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from kvtune.engine.async_engine import AsyncEngine, EngineDeadError
from kvtune.engine.engine import LLMEngine
from kvtune.front.admin import admin_refusal
from kvtune.front.body import read_json
from kvtune.front.errors import error_body

logger = logging.getLogger(__name__)


class AdminBounds(BaseModel):
    """The largest value each knob accepts on this engine."""

    max_num_seqs: int
    max_tokens_cap: int


class AdminConfig(BaseModel):
    max_num_seqs: int
    max_tokens_cap: int | None
    cap_mode: str
    bounds: AdminBounds


class AdminConfigPatch(BaseModel):
    """Fields absent from the body stay as they are; `"max_tokens_cap": null` removes the cap; `cap_mode`
    says what a request over the cap gets (clamp: a lower max_tokens, reject: a 400)."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: StrictInt | None = Field(default=None, ge=1)
    max_tokens_cap: StrictInt | None = Field(default=None, ge=1)
    cap_mode: Literal["clamp", "reject"] | None = None


def _current(engine: LLMEngine) -> AdminConfig:
    bounds = AdminBounds(max_num_seqs=engine.max_num_seqs_limit, max_tokens_cap=engine.max_model_len)
    return AdminConfig(
        max_num_seqs=engine.max_num_seqs,
        max_tokens_cap=engine.max_tokens_cap,
        cap_mode=engine.cap_mode,
        bounds=bounds,
    )


def build_admin_router(async_engine: AsyncEngine, token: str | None) -> APIRouter:
    """The admin routes, or an empty router when no token is configured (every admin path is then 404)."""
    router = APIRouter()
    if token is None:
        return router
    expected = f"Bearer {token}".encode()

    @router.get("/admin/config")
    async def get_config(request: Request) -> JSONResponse:
        if (refused := admin_refusal(request, expected)) is not None:
            return refused
        try:
            config = await async_engine.call(_current)
        except EngineDeadError as err:
            return JSONResponse(error_body(503, str(err)), status_code=503)
        return JSONResponse(config.model_dump())

    @router.patch("/admin/config")
    async def patch_config(request: Request) -> JSONResponse:
        if (refused := admin_refusal(request, expected)) is not None:
            return refused
        try:
            patch = AdminConfigPatch.model_validate(await read_json(request))
        except (ValueError, ValidationError) as err:
            return JSONResponse(error_body(400, f"invalid admin config: {err}"), status_code=400)
        fields = patch.model_fields_set

        def apply(engine: LLMEngine) -> AdminConfig:
            """Checks every field before changing any, so a rejected patch changes nothing."""
            if patch.max_num_seqs is not None:
                engine.check_max_num_seqs(patch.max_num_seqs)
            engine.check_max_tokens_cap(patch.max_tokens_cap)
            if "max_num_seqs" in fields and patch.max_num_seqs is not None:
                engine.set_max_num_seqs(patch.max_num_seqs)
            if "max_tokens_cap" in fields:
                engine.set_max_tokens_cap(patch.max_tokens_cap)
            if patch.cap_mode is not None:
                engine.set_cap_mode(patch.cap_mode)
            return _current(engine)

        for name in ("max_num_seqs", "cap_mode"):
            if name in fields and getattr(patch, name) is None:
                return JSONResponse(error_body(400, f"{name} cannot be null"), status_code=400)
        try:
            config = await async_engine.call(apply)
        except ValueError as err:
            return JSONResponse(error_body(400, str(err)), status_code=400)
        except EngineDeadError as err:
            return JSONResponse(error_body(503, str(err)), status_code=503)
        logger.info(
            "admin: max_num_seqs=%d max_tokens_cap=%s cap_mode=%s",
            config.max_num_seqs,
            config.max_tokens_cap,
            config.cap_mode,
        )
        return JSONResponse(config.model_dump())

    return router
