"""The Kubernetes emulator the operator tests share (kmock with optimistic concurrency), the metrics
server's handler, and builders for Deployments, policies, Secrets and the reads of what the operator wrote.
The fixtures over them are in conftest.py."""

from __future__ import annotations

import base64
import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import kmock

from kvtune.operator.k8s.kube_api import USER_AGENT
from tests.operator.helpers import reply

FIXTURES = Path(__file__).parent / "fixtures"


NS = "inference"


POLICIES = kmock.resource("kvtune.dev/v1alpha1/kvtuningpolicies")


DEPLOYMENTS = kmock.resource("apps/v1/deployments")


EVENTS = kmock.resource("v1/events")


SECRETS = kmock.resource("v1/secrets")


class OptimisticEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API server's optimistic concurrency for Deployments: a patch carrying a
    stale metadata.resourceVersion gets 409 Conflict and changes nothing; every accepted patch bumps it.
    `writers_before_next_patch` simulates other writers getting in between a read and a patch."""

    writers_before_next_patch = 0
    answered: list[int]

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource == DEPLOYMENTS and request.action == kmock.action.UPDATE:
            stored = self.objects[DEPLOYMENTS, request.namespace, request.name]
            if self.writers_before_next_patch:
                self.writers_before_next_patch -= 1
                stored.patch(
                    {"metadata": {"resourceVersion": str(int(stored["metadata"]["resourceVersion"]) + 1)}}
                )
            sent = (request.data or {}).get("metadata", {}).get("resourceVersion")
            if sent is not None and sent != stored["metadata"]["resourceVersion"]:
                self.answered.append(409)
                raise kmock.KubernetesError(
                    409, "Conflict", "the object has been modified; apply to the latest"
                )
            response = await super()._handle(request)
            stored.patch(
                {"metadata": {"resourceVersion": str(int(stored["metadata"]["resourceVersion"]) + 1)}}
            )
            self.answered.append(response.status)
            return response
        return await super()._handle(request)


class MetricsHandler(BaseHTTPRequestHandler):
    """/metrics from recorded files: the first read gets the first file, later reads the last one. A
    kvtune engine's `GET /admin/config` answers fixed knobs and records the bearer token it was sent."""

    def do_GET(self) -> None:
        server = self.server
        if self.path == "/admin/config":
            server.admin_tokens.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
            knobs = {"max_num_seqs": 64, "max_tokens_cap": None}
            reply(self, 200, "application/json", json.dumps(knobs).encode())
            return
        index = min(getattr(server, "reads", 0), len(server.files) - 1)  # type: ignore[attr-defined]
        server.reads = getattr(server, "reads", 0) + 1  # type: ignore[attr-defined]
        body = (FIXTURES / server.files[index]).read_bytes()  # type: ignore[attr-defined]
        reply(self, 200, "text/plain; version=0.0.4", body)

    def log_message(self, *args: Any) -> None:
        pass


def add_deployment(kube: OptimisticEmulator, args: list[str]) -> None:
    kube.objects[DEPLOYMENTS, NS, "llama"] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llama", "namespace": NS, "resourceVersion": "1", "generation": 1},
        "spec": {"template": {"spec": {"containers": [
            {"name": "sidecar", "image": "kvtune:latest", "args": ["proxy"]},
            {"name": "vllm", "image": "vllm/vllm-openai", "args": args},
        ]}}},
    }  # fmt: skip


def policy_spec(metrics_url: str, mode: str) -> dict[str, Any]:
    return {
        "target": {"name": "llama", "container": "vllm", "engine": "vllm"},
        "metrics": {"metricsUrl": metrics_url},
        "mode": mode,
        "bounds": {"minMaxNumSeqs": 2, "maxMaxNumSeqs": 256},
        "intervalSeconds": 1,
        "evaluationWindowSeconds": 30,
        "cooldownSeconds": 0,
        # these tests are about kopf's handlers acting through the Deployment on a recorded window; the
        # predicted move's first fit waits for a 5 s window (tests/operator/decide/test_predicted_move.py)
        "prediction": False,
    }


def add_policy(kube: OptimisticEmulator, spec: dict[str, Any]) -> None:
    kube.objects[POLICIES, NS, "llama"] = {
        "apiVersion": "kvtune.dev/v1alpha1",
        "kind": "KVTuningPolicy",
        "metadata": {
            "name": "llama",
            "namespace": NS,
            "uid": "uid-llama",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": spec,
    }


def container_args(kube: OptimisticEmulator) -> list[str]:
    return list(kube.objects[DEPLOYMENTS, NS, "llama"]["spec"]["template"]["spec"]["containers"][1]["args"])


def our_events(kube: OptimisticEmulator) -> list[dict[str, Any]]:
    return [request.data for request in kube[kmock.action.CREATE, EVENTS]
            if request.data.get("source", {}).get("component") == "kvtune-operator"]  # fmt: skip


def ours(requests: Any) -> list[kmock.Request]:
    """The requests our client made (kopf's own go to the same server)."""
    return [request for request in requests if request.headers.get("User-Agent") == USER_AGENT]


def status_writes(kube: OptimisticEmulator) -> list[kmock.Request]:
    """One per tick: every evaluation ends with a status patch."""
    return [r for r in ours(kube[kmock.action.UPDATE, POLICIES]) if r.subresource == "status"]


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions", [])}


def add_admin_secret(kube: OptimisticEmulator, token: str, resource_version: str) -> None:
    kube.objects[SECRETS, NS, "llama-admin"] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "llama-admin", "namespace": NS, "resourceVersion": resource_version},
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }
