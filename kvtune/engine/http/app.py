"""The FastAPI app: OpenAI routes, /v1/models, /health, /metrics, the prefix-defeat report and the admin
API, with errors as OpenAI-style JSON (`front.errors`), and a client that hung up answered 499.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvtune.contract.admin import ADMIN_CONFIG_PATH, AdminConfigPatch
from kvtune.contract.prefix_report import REPORT_PATH
from kvtune.engine.http import chat as chat_endpoint
from kvtune.engine.http import completions as completions_endpoint
from kvtune.engine.http.admin import build_admin_router
from kvtune.engine.http.memory_report import MEMORY_PATH, memory_report, tracing_frames
from kvtune.engine.http.metrics import CONTENT_TYPE, EngineMetrics
from kvtune.engine.http.openapi_schema import OPENAPI_URL, install_openapi
from kvtune.engine.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from kvtune.engine.http.serving import OpenAIServing
from kvtune.engine.http.stats_log import log_stats_forever
from kvtune.engine.http.streaming import ClientGoneError
from kvtune.engine.loop.thread import AsyncEngine
from kvtune.front.body import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimit
from kvtune.front.errors import CLIENT_CLOSED_REQUEST, error_body, install_error_handlers
from kvtune.front.prefix_report import prefix_report


def _install_error_handlers(app: FastAPI) -> None:
    install_error_handlers(app)

    @app.exception_handler(ClientGoneError)
    async def client_gone(_: Request, __: ClientGoneError) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


def build_app(
    async_engine: AsyncEngine,
    metrics: EngineMetrics | None = None,
    admin_token: str | None = None,
    log_stats_interval: float | None = 5.0,
    model_root: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    include_admin: bool = True,
    prefix_key_header: str | None = None,
) -> FastAPI:
    """The server around `async_engine`, whose thread starts and stops with the app's lifespan; request
    bodies over `max_request_body_bytes` get a 413 before they are buffered. `include_admin=False` leaves
    the admin routes to `build_admin_app` on a port of their own. `prefix_key_header`: the request header
    (a tenant) the prefix-defeat detector groups prompts by, instead of the model name."""
    engine = async_engine.engine
    metrics = metrics or EngineMetrics(engine)
    metrics.update(async_engine.latest)
    async_engine.add_listener(metrics.update)
    serving = OpenAIServing(async_engine, metrics.count_capped, prefix_key_header)
    detector = engine.prefix_detector
    decode_spans = engine.tokenizer.decode if engine.config.prefix_report_text else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger_task = None
        if log_stats_interval:
            logger_task = asyncio.create_task(log_stats_forever(async_engine, log_stats_interval))
        try:
            yield
        finally:
            if logger_task is not None:
                logger_task.cancel()
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="kvtune", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=OPENAPI_URL)
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completions_endpoint.create(serving, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat_endpoint.create(serving, request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=engine.served_model_name, root=model_root, max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return JSONResponse(error_body(503, "the engine is not running"), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if tracing_frames() is not None:

        @app.get(MEMORY_PATH, include_in_schema=False)
        async def memory() -> JSONResponse:
            # the tracemalloc snapshot walks every traced block: off the loop
            return JSONResponse(await asyncio.to_thread(memory_report))

    @app.get(REPORT_PATH, summary="Prefix-cache defeats seen so far: reasons, examples and fixes")
    async def prefix_defeat_report() -> JSONResponse:
        # Decoding spans and copying examples is the detector's lock plus a little CPU: off the loop.
        report = await asyncio.to_thread(prefix_report, detector, prefix_key_header, decode_spans)
        return JSONResponse(report)

    if include_admin:
        app.include_router(build_admin_router(async_engine, admin_token))
    install_openapi(
        app,
        {
            ("/v1/completions", "post"): CompletionRequest,
            ("/v1/chat/completions", "post"): ChatCompletionRequest,
            (ADMIN_CONFIG_PATH, "patch"): AdminConfigPatch,
        },
        admin_paths=("/admin/",),
    )
    return app


def build_admin_app(
    async_engine: AsyncEngine,
    admin_token: str | None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """Only the admin routes, for `--admin-port`: a port a NetworkPolicy can keep private. The engine's
    lifecycle stays with the main app, which runs in the same process."""
    app = FastAPI(title="kvtune admin", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    app.include_router(build_admin_router(async_engine, admin_token))
    return app
