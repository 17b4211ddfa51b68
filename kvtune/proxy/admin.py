"""`GET`/`PATCH /admin/config` on the proxy: the live max_tokens cap and its mode, no restart.

The engine's routes (`front.admin`: the bearer-token guard, 404 without a token, 400s for unknown fields and
bad values), so the operator sets the cap in front of vLLM or SGLang exactly as on a kvtune engine;
`"max_tokens_cap": null` removes the cap. The proxy has no `max_num_seqs` to offer: that one stays the
upstream's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from kvtune.contract.admin import CapSetting, ProxyAdminConfig, ProxyAdminConfigPatch
from kvtune.front.admin import admin_router
from kvtune.front.body import parse_json
from kvtune.proxy.request_intake import read_body


def build_proxy_admin_router(
    token: str | None,
    current: Callable[[], CapSetting],
    change: Callable[[CapSetting], None],
    max_body_bytes: int,
) -> APIRouter:
    """The admin routes over the live cap (`current` reads it, `change` installs a new one), or an empty
    router when no token is configured."""

    def config_of(setting: CapSetting) -> ProxyAdminConfig:
        return ProxyAdminConfig(max_tokens_cap=setting.cap, cap_mode=setting.mode)

    async def read_config() -> ProxyAdminConfig:
        return config_of(current())

    async def apply_patch(patch: ProxyAdminConfigPatch) -> ProxyAdminConfig:
        before = current()
        cap = patch.max_tokens_cap if "max_tokens_cap" in patch.model_fields_set else before.cap
        setting = CapSetting(cap, patch.cap_mode or before.mode)
        change(setting)
        return config_of(setting)

    async def read_json(request: Request) -> Any:
        return parse_json(await read_body(request, max_body_bytes))

    return admin_router(token, ProxyAdminConfigPatch, read_config, apply_patch, read_json)
