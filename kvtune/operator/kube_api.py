"""A small synchronous Kubernetes API client over httpx: the few calls the operator makes (get, merge-patch,
create) with the credentials kopf itself would use (in-cluster service account, else kubeconfig).

Synchronous on purpose: the Actuator protocol is synchronous, and the kopf handlers run a whole evaluation
in a worker thread so the event loop stays free.
"""

from __future__ import annotations

import base64
import ssl
from dataclasses import dataclass
from typing import Any

import httpx
import kopf

MERGE_PATCH = "application/merge-patch+json"
Json = dict[str, Any]


@dataclass(frozen=True)
class KubeError(Exception):
    status: int  # 0: the API server could not be reached
    reason: str
    message: str

    def __str__(self) -> str:
        return f"HTTP {self.status} {self.reason}: {self.message}" if self.status else self.message


class KubeApi:
    def __init__(
        self,
        server: str,
        token: str | None = None,
        verify: bool | ssl.SSLContext = True,
        cert: tuple[str, str] | None = None,
        timeout: float = 10.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.server = server.rstrip("/")
        self.client = httpx.Client(
            base_url=self.server, headers=headers, verify=verify, cert=cert, timeout=timeout
        )

    @staticmethod
    def from_connection(info: kopf.ConnectionInfo) -> KubeApi:
        """Use a kopf ConnectionInfo (token, CA, client certificate files, insecure flag)."""
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
            raise KubeError(
                0, "Unsupported", "client-certificate-data is not supported: use a token or files"
            )
        cert = None
        if info.certificate_path and info.private_key_path:
            cert = (str(info.certificate_path), str(info.private_key_path))
        return KubeApi(info.server, info.token, verify, cert)

    @staticmethod
    def from_environment(settings: kopf.OperatorSettings | None = None) -> KubeApi:
        """The service account inside a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
        settings = settings or kopf.OperatorSettings()
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
            settings=settings
        )
        if info is None:
            raise KubeError(0, "NoCredentials", "no service account token and no kubeconfig")
        return KubeApi.from_connection(info)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> KubeApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self, method: str, path: str, body: Json | None = None, content_type: str | None = None
    ) -> Json:
        headers = {"Content-Type": content_type} if content_type else {}
        try:
            response = self.client.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as err:
            raise KubeError(0, "Unreachable", f"{method} {path}: {type(err).__name__}: {err}") from None
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

    def merge_patch(self, path: str, body: Json) -> Json:
        return self.request("PATCH", path, body, MERGE_PATCH)

    def create(self, path: str, body: Json) -> Json:
        return self.request("POST", path, body)


def deployment_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"


def secret_value(api: KubeApi, namespace: str, name: str, key: str) -> str:
    """One key of a Secret, decoded."""
    secret = api.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
    encoded = (secret.get("data") or {}).get(key)
    if encoded is None:
        raise KubeError(404, "KeyNotFound", f"secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(encoded).decode().strip()
