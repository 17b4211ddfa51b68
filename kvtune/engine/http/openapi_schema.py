"""The OpenAPI document of `kvtune serve`: the routes FastAPI knows, plus the request bodies the handlers
parse themselves.

The generate and admin handlers read their bodies by hand (to answer a 400 in OpenAI's error shape, under
size and depth limits, instead of FastAPI's 422), so FastAPI cannot see their body models. This fills them
in from the same pydantic models the handlers validate with, so a client generator and the API fuzz test
read one truthful schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

OPENAPI_URL = "/openapi.json"
ADMIN_SECURITY_SCHEME = "adminBearer"


def _body_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    """A `$ref` to `model` in `components`, which also receives every model it nests."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def install_openapi(
    app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]], admin_paths: tuple[str, ...] = ()
) -> None:
    """Serve the document at OPENAPI_URL with `bodies[(path, method)]` as those operations' JSON bodies;
    operations under `admin_paths` are marked as needing the admin bearer token."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})
        for (path, method), model in bodies.items():
            operation = schema.get("paths", {}).get(path, {}).get(method)
            if operation is None:  # a route this app does not serve (say, admin without a token)
                continue
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _body_schema(model, components)}},
            }
        admin_operations = [
            operation
            for path, item in schema.get("paths", {}).items()
            if path.startswith(admin_paths)
            for operation in item.values()
        ]
        if admin_paths and admin_operations:
            schemes = schema["components"].setdefault("securitySchemes", {})
            schemes[ADMIN_SECURITY_SCHEME] = {"type": "http", "scheme": "bearer"}
            for operation in admin_operations:
                operation["security"] = [{ADMIN_SECURITY_SCHEME: []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
