"""A PATCH that must not outlive the data it was decided on (decide/freshness.py): the API server is told
to give up on it at its deadline (its `timeout` query parameter: the request's context deadline, so a write
held while etcd is away is abandoned rather than stored once etcd is back), the client waits hardly longer,
and nothing retries it (a retry would carry the same relative timeout, and land later). The next evaluation
decides again instead.

One call, made with the ApiClient `KubeApi` holds (its credentials, TLS and connection pool); it answers as
the generated client does with `_preload_content=False` (an object with `.data`) and raises ApiException for
an error status, so `KubeApi` treats it as every other call."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

CLIENT_MARGIN_S = 1.0  # the client waits this much past the server's deadline, for its 504 answer
MIN_SERVER_TIMEOUT_MS = 1
PLURALS = {"Deployment": "deployments", "StatefulSet": "statefulsets"}


def workload_path(kind: str, namespace: str, name: str) -> str:
    """An apps/v1 workload's path on the API server."""
    return f"/apis/apps/v1/namespaces/{namespace}/{PLURALS[kind]}/{name}"


def bounded_patch(
    api_client: client.ApiClient, path: str, body: dict[str, Any], deadline: float, content_type: str,
    field_manager: str, clock: Callable[[], float] = time.time,
) -> Any:  # fmt: skip
    """PATCH `path` with `body`, given up on by the API server at `deadline` (a `clock` time) and never
    retried; not sent at all once the deadline has passed."""
    milliseconds = math.floor((deadline - clock()) * 1000)
    if milliseconds < MIN_SERVER_TIMEOUT_MS:
        message = f"not sent: its deadline passed {-milliseconds / 1000:.1f} s ago"
        raise ApiException(0, "DeadlinePassed", body=json.dumps({"message": message}))
    query = [("fieldManager", field_manager), ("timeout", f"{milliseconds}ms")]
    method, url, headers, _, _ = api_client.param_serialize(
        "PATCH", path, query_params=query, header_params={"Accept": "application/json",
        "Content-Type": content_type}, auth_settings=["BearerToken"],
    )  # fmt: skip
    response = api_client.rest_client.pool_manager.request(
        method, url, body=json.dumps(body).encode(), headers=headers, retries=False,
        timeout=urllib3.Timeout(total=milliseconds / 1000 + CLIENT_MARGIN_S), preload_content=True,
    )  # fmt: skip
    if not 200 <= response.status < 300:
        raise ApiException(response.status, response.reason, body=response.data.decode(errors="replace"))
    return response
