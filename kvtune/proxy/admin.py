"""`GET`/`PATCH /admin/config` on the proxy: the live max_tokens cap and its mode, no restart.

The engine's routes (`front.admin`: the bearer-token guard, 404 without a token, 400s for unknown fields and
bad values), so the operator sets the cap in front of vLLM or SGLang exactly as on a kvtune engine;
`"max_tokens_cap": null` removes the cap. The proxy has no `max_num_seqs` to offer: that one stays the
upstream's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvtune.front.admin import admin_router
from kvtune.front.body import parse_json
from kvtune.proxy.cap import CapPolicy
from kvtune.proxy.door import read_body


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

    def config_of(policy: CapPolicy) -> ProxyAdminConfig:
        return ProxyAdminConfig(max_tokens_cap=policy.cap, cap_mode=policy.mode)

    async def read_config() -> ProxyAdminConfig:
        return config_of(current())

    async def apply_patch(patch: ProxyAdminConfigPatch) -> ProxyAdminConfig:
        before = current()
        cap = patch.max_tokens_cap if "max_tokens_cap" in patch.model_fields_set else before.cap
        policy = CapPolicy(cap, patch.cap_mode or before.mode)
        change(policy)
        return config_of(policy)

    async def read_json(request: Request) -> Any:
        return parse_json(await read_body(request, max_body_bytes))

    return admin_router(token, ProxyAdminConfigPatch, read_config, apply_patch, read_json)
