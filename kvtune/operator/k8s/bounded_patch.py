"""A change is made on fresh data or not at all (`Freshness`): an evaluation's writes must land within one
interval of the data it decided on. A write that would land later (the API server or etcd away, and the call
waiting or retried) is not made; it is reported as a failed apply, and the next evaluation decides again on
what it reads then. Without this, a patch held through an outage lands after the world it was decided on has
moved, and the next evaluation's reading of it is no longer the one the history says.

The PATCH that enforces it (`bounded_patch`) must not outlive that data: the API server is told
to give up on it at its deadline (its `timeout` query parameter: the request's context deadline, so a write
held while etcd is away is abandoned rather than stored once etcd is back), the client waits hardly longer,
and nothing retries it (a retry would carry the same relative timeout, and land later). The next evaluation
decides again instead.

One call, made with the ApiClient `KubeApi` holds (its credentials, TLS and connection pool); it answers as
the generated client does with `_preload_content=False` (an object with `.data`) and raises ApiException for
an error status, so `KubeApi` treats it as every other call. `Freshness` is pure: the time is passed in
(the actuator holds the clock)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Freshness:
    """The data an evaluation decided on: read at `read_at` (the evaluation's start, so never later than
    the read itself), usable for `interval_s` (the policy's interval)."""

    read_at: float
    interval_s: float

    @property
    def deadline(self) -> float:
        """The last moment a write decided on this data may land."""
        return self.read_at + self.interval_s

    def remaining(self, now: float) -> float:
        """How long a write made at `now` may take, at most, to still land in time (<= 0: too late)."""
        return self.deadline - now

    def stale(self, now: float) -> str | None:
        """Why a write at `now` may not be made (the data is older than one interval), or None when it may."""
        age = now - self.read_at
        if age < self.interval_s:
            return None
        return (
            f"decided on data {age:.1f} s old, more than one interval ({self.interval_s:g} s): not applied; "
            "the next evaluation decides again"
        )
