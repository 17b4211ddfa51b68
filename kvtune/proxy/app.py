"""The proxy's FastAPI app: the OpenAI routes forwarded to the upstream, /health, /metrics, the prefix
report and the admin API, every error an OpenAI-style JSON body.

The generate routes are served in front of the FastAPI app (`generate.GenerateFastPath`): a request is
read and parsed once at intake (`request_intake.py`); the cap decides whether its bytes go upstream
unchanged or rewritten; the exchange itself (`relay.Forward`) starts the upstream request, and hands the
parsed body to the prefix watch once the answer's first byte has been relayed, so tokenizing never
delays the first token.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvtune.contract.admin import CapSetting
from kvtune.contract.prefix_report import REPORT_PATH
from kvtune.front.body import DEFAULT_MAX_REQUEST_BODY_BYTES
from kvtune.front.errors import error_body, install_error_handlers
from kvtune.proxy.accounting import RequestRecord
from kvtune.proxy.admin import build_proxy_admin_router
from kvtune.proxy.generate import GenerateFastPath
from kvtune.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from kvtune.proxy.prefix_watch import PrefixWatch
from kvtune.proxy.relay import Forward
from kvtune.proxy.upstream import Upstream, UpstreamError, forwardable


@dataclass
class ProxyCore:
    """What every route shares: the upstream, the prefix watch, the metrics and the live cap."""

    upstream: Upstream
    watch: PrefixWatch
    metrics: ProxyMetrics
    cap_setting: CapSetting = field(default_factory=CapSetting)
    prefix_key_header: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES

    def __post_init__(self) -> None:
        self.metrics.set_cap(self.cap_setting.cap)

    def current_cap_setting(self) -> CapSetting:
        return self.cap_setting

    def set_cap_setting(self, setting: CapSetting) -> None:
        self.cap_setting = setting
        self.metrics.set_cap(setting.cap)

    def prefix_key(self, tenant: str | None, model: object) -> str:
        """The detector's key: the tenant header's value (`tenant`) when one is configured and sent, else
        the model."""
        if self.prefix_key_header and tenant:
            return tenant
        return model if isinstance(model, str) else ""

    async def aclose(self) -> None:
        await self.upstream.aclose()
        self.watch.close()


class _ForwardResponse(Response):
    """Lets FastAPI hand the ASGI exchange through as a response (FastAPI serializes anything else)."""

    def __init__(self, exchange: Forward) -> None:
        super().__init__()
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.exchange(scope, receive, send)


def build_proxy_app(
    core: ProxyCore, admin_token: str | None = None, include_admin: bool = True
) -> GenerateFastPath:
    """The proxy around `core`, whose upstream client closes with the app's lifespan: the generate routes
    on their fast path, the rest a FastAPI app. `include_admin=False` leaves the admin routes to
    `build_proxy_admin_app` on a port of their own."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await core.aclose()

    app = FastAPI(title="kvtune proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        record = RequestRecord(core.metrics, "models")
        headers = forwardable(request.headers.items(), keep_length=False)
        return _ForwardResponse(Forward(core.upstream, "GET", "/v1/models", headers, record))

    @app.get("/health")
    async def health() -> JSONResponse:
        status = await core.upstream.health()
        if status == 200:
            return JSONResponse({"status": "ok", "upstream": core.upstream.base_url})
        if isinstance(status, UpstreamError):
            message = status.message
        else:
            message = (
                f"the upstream {core.upstream.base_url} is not healthy: its /health answered HTTP {status}"
            )
        return JSONResponse(error_body(503, message), 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(core.metrics.render(), media_type=CONTENT_TYPE)

    @app.get(REPORT_PATH)
    async def prefix_report() -> JSONResponse:
        return JSONResponse(core.watch.report())

    if include_admin:
        app.include_router(
            build_proxy_admin_router(
                admin_token, core.current_cap_setting, core.set_cap_setting, core.max_request_body_bytes
            )
        )
    return GenerateFastPath(app, core)


def build_proxy_admin_app(core: ProxyCore, admin_token: str | None) -> FastAPI:
    """Only the admin routes, for `--admin-port`: a port a NetworkPolicy can keep private."""
    app = FastAPI(title="kvtune proxy admin", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.include_router(
        build_proxy_admin_router(
            admin_token, core.current_cap_setting, core.set_cap_setting, core.max_request_body_bytes
        )
    )
    return app
