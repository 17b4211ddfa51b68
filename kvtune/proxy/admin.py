"""`GET`/`PATCH /admin/config` on the proxy: the live max_tokens cap and its mode, no restart.

The same contract as the engine's admin API (kvtune/engine/admin.py), so the operator sets the cap
in front of vLLM or SGLang exactly as on a kvtune engine: a bearer token read from a file (in exactly one
Authorization header, `admin_auth`), no routes at all (404) without one, `"max_tokens_cap": null` removes
the cap, unknown fields and bad values are 400s and a rejected patch changes nothing. The proxy has no `max_num_seqs` to offer: that one stays the upstream's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from kvtune.front.admin import admin_refusal
from kvtune.front.body import RequestBodyError, parse_json
from kvtune.front.errors import error_body
from kvtune.proxy.cap import CapPolicy
from kvtune.proxy.door import read_body

logger = logging.getLogger(__name__)


class ProxyAdminConfig(BaseModel):
    max_tokens_cap: int | None
    cap_mode: Literal["clamp", "reject"]


class ProxyAdminConfigPatch(BaseModel):
    """Fields absent from the body stay as they are; `"max_tokens_cap": null` removes the cap."""

    model_config = ConfigDict(extra="forbid")

    max_tokens_cap: StrictInt | None = Field(default=None, ge=1)
    cap_mode: Literal["clamp", "reject"] | None = None


def build_proxy_admin_router(
    token: str | None,
    current: Callable[[], CapPolicy],
    change: Callable[[CapPolicy], None],
    max_body_bytes: int,
) -> APIRouter:
    """The admin routes over the live cap (`current` reads it, `change` installs a new one), or an empty
    router when no token is configured."""
    router = APIRouter()
    if token is None:
        return router
    expected = f"Bearer {token}".encode()

    def config_of(policy: CapPolicy) -> JSONResponse:
        return JSONResponse(ProxyAdminConfig(max_tokens_cap=policy.cap, cap_mode=policy.mode).model_dump())

    @router.get("/admin/config")
    async def get_config(request: Request) -> JSONResponse:
        if (refused := admin_refusal(request, expected)) is not None:
            return refused
        return config_of(current())

    @router.patch("/admin/config")
    async def patch_config(request: Request) -> JSONResponse:
        if (refused := admin_refusal(request, expected)) is not None:
            return refused
        try:
            patch = ProxyAdminConfigPatch.model_validate(parse_json(await read_body(request, max_body_bytes)))
        except RequestBodyError as err:
            return err.response()
        except (ValueError, ValidationError) as err:
            return JSONResponse(error_body(400, f"invalid admin config: {err}"), status_code=400)
        if "cap_mode" in patch.model_fields_set and patch.cap_mode is None:
            return JSONResponse(error_body(400, "cap_mode cannot be null"), status_code=400)
        before = current()
        cap = patch.max_tokens_cap if "max_tokens_cap" in patch.model_fields_set else before.cap
        policy = CapPolicy(cap, patch.cap_mode or before.mode)
        change(policy)
        logger.info("admin: max_tokens_cap=%s cap_mode=%s", policy.cap, policy.mode)
        return config_of(policy)

    return router
