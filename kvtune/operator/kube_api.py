"""A small synchronous Kubernetes API client over httpx: the few calls the operator makes (get, merge-patch,
create) with the credentials kopf itself would use (in-cluster service account, else kubeconfig).

Synchronous on purpose: the Actuator protocol is synchronous, and the kopf handlers run a whole evaluation
in a worker thread so the event loop stays free.
"""

from __future__ import annotations

import base64
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import kopf

MERGE_PATCH = "application/merge-patch+json"
# metadata only (no data travels), or the whole object from an API server that cannot answer that
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"
USER_AGENT = "kvtune-operator"
Json = dict[str, Any]
Login = Callable[[], kopf.ConnectionInfo]


@dataclass(frozen=True)
class KubeError(Exception):
    status: int  # 0: the API server could not be reached
    reason: str
    message: str

    def __str__(self) -> str:
        return f"HTTP {self.status} {self.reason}: {self.message}" if self.status else self.message


def _client(info: kopf.ConnectionInfo, timeout: float) -> httpx.Client:
    """An HTTP client for a kopf ConnectionInfo (token, CA, client certificate files, insecure flag)."""
    verify: bool | ssl.SSLContext = not info.insecure
    if verify and (info.ca_path or info.ca_data):
        context = ssl.create_default_context()
        if info.ca_path:
            context.load_verify_locations(cafile=str(info.ca_path))
        else:
            data = info.ca_data.encode() if isinstance(info.ca_data, str) else info.ca_data
            context.load_verify_locations(cadata=base64.b64decode(data or b"").decode())
        verify = context
    if info.certificate_data or info.private_key_data:
        raise KubeError(0, "Unsupported", "client-certificate-data is not supported: use a token or files")
    cert = None
    if info.certificate_path and info.private_key_path:
        cert = (str(info.certificate_path), str(info.private_key_path))
    headers = {"User-Agent": USER_AGENT}
    if info.token:
        headers["Authorization"] = f"Bearer {info.token}"
    return httpx.Client(
        base_url=info.server.rstrip("/"), headers=headers, verify=verify, cert=cert, timeout=timeout
    )


class KubeApi:
    """One per process, shared by every evaluation: it logs in once, and again only when the API server
    answers 401 Unauthorized (a service-account token is rotated on disk while the pod runs)."""

    def __init__(self, login: Login, timeout: float = 10.0) -> None:
        self._login = login
        self._timeout = timeout
        self._lock = threading.Lock()
        self.client = _client(login(), timeout)

    @staticmethod
    def from_environment(settings: kopf.OperatorSettings | None = None) -> KubeApi:
        """The service account inside a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
        chosen = settings or kopf.OperatorSettings()

        def login() -> kopf.ConnectionInfo:
            info = kopf.login_with_service_account(settings=chosen) or kopf.login_with_kubeconfig(
                settings=chosen
            )
            if info is None:
                raise KubeError(0, "NoCredentials", "no service account token and no kubeconfig")
            return info

        return KubeApi(login)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> KubeApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _relogin(self, stale: httpx.Client) -> None:
        """Log in again, once for every thread that met the stale credentials."""
        with self._lock:
            if self.client is stale:
                self.client = _client(self._login(), self._timeout)
                stale.close()

    def _send(self, method: str, path: str, body: Json | None, headers: dict[str, str]) -> httpx.Response:
        client = self.client
        try:
            response = client.request(method, path, json=body, headers=headers)
            if response.status_code == 401:
                self._relogin(client)
                response = self.client.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as err:
            raise KubeError(0, "Unreachable", f"{method} {path}: {type(err).__name__}: {err}") from None
        return response

    def request(
        self,
        method: str,
        path: str,
        body: Json | None = None,
        content_type: str | None = None,
        accept: str | None = None,
    ) -> Json:
        headers = {"Content-Type": content_type} if content_type else {}
        if accept:
            headers["Accept"] = accept
        response = self._send(method, path, body, headers)
        if response.status_code >= 400:
            try:
                status = response.json()
                reason, message = str(status.get("reason", "")), str(status.get("message", ""))
            except ValueError:
                reason, message = response.reason_phrase, response.text[:200]
            raise KubeError(response.status_code, reason, f"{method} {path}: {message}")
        try:
            data = response.json()
        except ValueError:
            raise KubeError(response.status_code, "BadBody", f"{method} {path}: not JSON") from None
        return data if isinstance(data, dict) else {}

    def get(self, path: str) -> Json:
        return self.request("GET", path)

    def get_metadata(self, path: str) -> Json:
        """An object's metadata alone: enough to see whether it changed since it was last read."""
        return self.request("GET", path, accept=METADATA_ONLY)

    def merge_patch(self, path: str, body: Json) -> Json:
        return self.request("PATCH", path, body, MERGE_PATCH)

    def create(self, path: str, body: Json) -> Json:
        return self.request("POST", path, body)

    def list_endpoint_slices(self, namespace: str, service: str) -> list[Json]:
        """The EndpointSlices of one Service (discovery.k8s.io/v1, by the kubernetes.io/service-name label).
        Temporary, for issue 15's many-replica work: the facade on the official client replaces it."""
        path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        found = self.get(f"{path}?labelSelector=kubernetes.io%2Fservice-name%3D{service}")
        return [item for item in found.get("items") or [] if isinstance(item, dict)]


def deployment_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"


def secret_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/secrets/{name}"
