"""The proxy's two generate routes (completions, chat completions), served in front of its FastAPI app.

Every forwarded request pays for what sits between the socket and the handler; FastAPI's routing,
middleware stack and dependency solving cost about as much CPU per request as the forwarding itself. The
generate routes need none of it: the body is read from `receive` under the size limit, parsed once,
capped, and handed to `relay.Forward`, which is already an ASGI response. Everything else (models, health,
metrics, the prefix report, the admin API, and these paths with another method) goes to the FastAPI app
unchanged, and every answer keeps the shape the FastAPI routes gave it.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from kvtune.contract.admin import CAP_HEADER
from kvtune.front.body import RequestBodyError
from kvtune.front.errors import CLIENT_CLOSED_REQUEST, error_body, internal_error
from kvtune.front.max_tokens_cap import OVER_CAP_CODE
from kvtune.proxy.accounting import RequestRecord
from kvtune.proxy.cap import CHAT_FIELDS, COMPLETION_FIELDS, cap_body
from kvtune.proxy.prefix_watch import CHAT_COMPLETIONS, COMPLETIONS
from kvtune.proxy.relay import Forward
from kvtune.proxy.request_intake import parse_object, read_asgi_body
from kvtune.proxy.upstream import HOP_BY_HOP

if TYPE_CHECKING:
    from kvtune.proxy.app import ProxyCore


# path -> (endpoint label, the fields that carry max_tokens)
GENERATE_ROUTES = {
    "/v1/completions": (COMPLETIONS, COMPLETION_FIELDS),
    "/v1/chat/completions": (CHAT_COMPLETIONS, CHAT_FIELDS),
}
# The request headers the upstream does not get: hop-by-hop ones, and the length of a body the cap may
# rewrite (the transport sets it).
NOT_FORWARDED = frozenset(name.encode("latin-1") for name in HOP_BY_HOP | {"content-length"})


class GenerateFastPath:
    """ASGI app: POST to a generate route is served here, any other request by `app`."""

    def __init__(self, app: ASGIApp, core: ProxyCore) -> None:
        self.app = app
        self.core = core
        self.key_header = core.prefix_key_header.lower().encode("latin-1") if core.prefix_key_header else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = GENERATE_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        endpoint, fields = route
        try:
            exchange = await self._prepare(endpoint, fields, scope, receive)
        except Exception as err:  # answered as the FastAPI app's catch-all handler answers
            exchange = internal_error(err)
        try:
            await exchange(scope, receive, send)
        except Exception as err:
            if isinstance(exchange, Forward) and exchange.response_started:
                raise
            await internal_error(err)(scope, receive, send)

    async def _prepare(
        self, endpoint: str, fields: tuple[str, ...], scope: Scope, receive: Receive
    ) -> Forward | Response:
        """The exchange to run, or the answer that replaces it (a refused body, a client already gone);
        the request is counted once either way."""
        core = self.core
        record = RequestRecord(core.metrics, endpoint)
        try:
            headers: list[tuple[str, str]] = []
            declared: bytes | None = None
            tenant: bytes | None = None
            for name, value in scope["headers"]:
                if name == b"content-length":
                    declared = value
                elif name == self.key_header and tenant is None:
                    tenant = value
                if name not in NOT_FORWARDED:
                    headers.append((name.decode("latin-1"), value.decode("latin-1")))
            raw = await read_asgi_body(receive, declared, core.max_request_body_bytes)
            body = await parse_object(raw)
            capped = cap_body(body, fields, core.cap_setting)
            if capped.counted_as is not None:
                core.metrics.capped.labels(capped.counted_as).inc()
            if capped.error is not None:
                record.finish("rejected")
                return JSONResponse(error_body(400, capped.error, capped.param, OVER_CAP_CODE), 400)
            key = tenant.decode("latin-1") if tenant else core.prefix_key(None, body.get("model"))
            return Forward(
                core.upstream,
                "POST",
                scope["path"],
                headers,
                record,
                content=capped.content if capped.content is not None else raw,
                extra_headers=[(CAP_HEADER, capped.header)] if capped.header else [],
                observe=partial(core.watch.submit, endpoint, body, key),
            )
        except RequestBodyError as err:
            record.finish("rejected")
            return err.response()
        except ClientDisconnect:  # gone while uploading: nobody is left to answer
            record.finish("failed")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:
            record.finish("failed")
            raise
