"""Kubernetes API calls as RBAC sees them, from kmock's recorded requests: the proof that the chart's Role or
ClusterRole grants exactly what the operator (our client and kopf) uses. Discovery (`/api`, `/apis/...`)
is left out: every authenticated user may read it (the built-in system:discovery role)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import kmock

from kvtune.operator.k8s.kube_api import USER_AGENT

WATCH_VALUES = {"true", "1"}


class ApiCall(NamedTuple):
    verb: str  # RBAC verb: get, list, watch, create, patch, update, delete, deletecollection
    group: str  # "" for the core group
    resource: str  # plural
    subresource: str  # "" when none
    namespace: str  # "" for cluster-scoped calls
    name: str  # only for Secrets (RBAC resourceNames: the operator reads only the Secrets policies name)


def rbac_verb(request: kmock.Request) -> str:
    method = str(request.method.value).upper()
    if method == "GET":
        if str(request.params.get("watch", "")).lower() in WATCH_VALUES:
            return "watch"
        return "get" if request.name else "list"
    if method == "DELETE":
        return "delete" if request.name else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method, method.lower())


def from_operator(request: kmock.Request) -> bool:
    """Made by the operator: our client or kopf (not the test's own setup calls)."""
    agent = str(request.headers.get("User-Agent", ""))
    return agent == USER_AGENT or agent.startswith("kopf/")


def api_calls(requests: Iterable[kmock.Request]) -> set[ApiCall]:
    """Every resource call the operator made among `requests` (e.g. `list(kmock_server)`), deduplicated."""
    calls: set[ApiCall] = set()
    for request in filter(from_operator, requests):
        resource = request.resource
        if resource is None or not resource.plural:
            continue  # discovery
        calls.add(
            ApiCall(
                rbac_verb(request),
                resource.group or "",
                resource.plural,
                request.subresource or "",
                request.namespace or "",
                (request.name or "") if resource.plural == "secrets" else "",
            )
        )
    return calls
