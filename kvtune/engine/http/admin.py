"""`GET`/`PATCH /admin/config`: the operator's live levers (max_num_seqs, the max_tokens cap and its mode).

The routes, their bearer-token guard and their refusals are the front's (`front.admin`), shared with the
proxy; this module says what the engine holds and how it changes it. Changes run on the engine thread
between steps; lowering max_num_seqs evicts nobody, admission just waits. Every value has an upper bound
the engine itself enforces (`LLMEngine.check_*`): max_num_seqs at most the pool's blocks, the cap at most
max_model_len; `GET` returns the bounds so a client can stay inside them.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from kvtune.contract.admin import AdminBounds, AdminConfig, AdminConfigPatch
from kvtune.engine.loop.errors import EngineDeadError
from kvtune.engine.loop.llm_engine import LLMEngine
from kvtune.engine.loop.thread import AsyncEngine
from kvtune.front.admin import admin_router
from kvtune.front.body import read_json
from kvtune.front.errors import ApiError


def _current(engine: LLMEngine) -> AdminConfig:
    bounds = AdminBounds(max_num_seqs=engine.max_num_seqs_limit, max_tokens_cap=engine.max_model_len)
    return AdminConfig(
        max_num_seqs=engine.max_num_seqs,
        max_tokens_cap=engine.max_tokens_cap,
        cap_mode=engine.cap_mode,
        bounds=bounds,
    )


def build_admin_router(async_engine: AsyncEngine, token: str | None) -> APIRouter:
    """The admin routes over the live engine (read and changed on its thread), or an empty router when no
    token is configured."""

    async def on_engine(fn: Callable[[LLMEngine], AdminConfig]) -> AdminConfig:
        try:
            return await async_engine.call(fn)
        except EngineDeadError as err:
            raise ApiError(503, str(err)) from None

    async def read_config() -> AdminConfig:
        return await on_engine(_current)

    async def apply_patch(patch: AdminConfigPatch) -> AdminConfig:
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

        return await on_engine(apply)

    return admin_router(token, AdminConfigPatch, read_config, apply_patch, read_json)
