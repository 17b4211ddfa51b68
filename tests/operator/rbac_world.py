"""The RBAC proof's builders: the recorded calls as grants, the peering objects, and an old vLLM image's
handler and policy (shared with the e2e RBAC and peering tests)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import kmock

from tests.operator.api_calls import ApiCall
from tests.operator.helpers import reply
from tests.operator.kmock_world import NS, MetricsHandler, OptimisticEmulator, fast_policy

PEERING = "kvtune"


PEERINGS = kmock.resource("kopf.dev/v1/kopfpeerings")


CLUSTER_PEERINGS = kmock.resource("kopf.dev/v1/clusterkopfpeerings")


OLD_VLLM_IMAGE = "vllm/vllm-openai:v0.31.0"  # lacks --max-num-active-seqs: --max-num-seqs is patched


STS_MAX_NUM_SEQS = 48


class Grant(NamedTuple):
    """One permission of a Role or ClusterRole, one verb on one resource[/subresource] (and name)."""

    verb: str
    group: str
    resource: str
    subresource: str
    name: str  # "" when the rule names no resourceNames (any object)


class VllmHandler(MetricsHandler):
    """A vLLM engine's /metrics (the recorded files) and its `GET /version` when the server has one."""

    def do_GET(self) -> None:
        if self.path == "/version":
            version = self.server.version  # type: ignore[attr-defined]
            if version is None:
                reply(self, 404, "application/json", b'{"detail": "Not Found"}')
            else:
                reply(self, 200, "application/json", json.dumps({"version": version}).encode())
            return
        super().do_GET()


def vllm_policy(kind: str, name: str, engine_url: str) -> dict[str, Any]:
    target = {"kind": kind, "name": name, "container": "vllm", "engine": "vllm"}
    return fast_policy(target, metrics={"metricsUrl": f"{engine_url}/metrics"})


def add_peering(cluster: OptimisticEmulator, clusterwide: bool) -> None:
    """The peering object the chart installs: a KopfPeering in the watched namespace, or a ClusterKopfPeering."""
    kind = "ClusterKopfPeering" if clusterwide else "KopfPeering"
    resource, namespace = (CLUSTER_PEERINGS, None) if clusterwide else (PEERINGS, NS)
    cluster.resources[f"kopf.dev/v1/{kind.lower()}s"] = kmock.ResourceInfo(
        kind=kind, namespaced=not clusterwide
    )
    metadata = {"name": PEERING, "resourceVersion": "1", **({"namespace": namespace} if namespace else {})}
    cluster.objects[resource, namespace, PEERING] = {
        "apiVersion": "kopf.dev/v1",
        "kind": kind,
        "metadata": metadata,
        "status": {},
    }


def rule_grants(role: dict[str, Any]) -> set[Grant]:
    """A Role's or ClusterRole's rules as single grants; a wildcard is never least privilege."""
    grants: set[Grant] = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for full in rule["resources"]:
                resource, _, subresource = full.partition("/")
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or [""]:
                        grant = Grant(verb, group, resource, subresource, name)
                        assert "*" not in grant, f"a wildcard in {rule}"
                        grants.add(grant)
    return grants


def as_grant(call: ApiCall) -> Grant:
    return Grant(call.verb, call.group, call.resource, call.subresource, call.name)


def granting(call: ApiCall, grants: set[Grant], namespace: str | None) -> set[Grant]:
    """The grants that allow `call`: a Role's only in its own namespace (never a cluster-scoped call);
    a grant without resourceNames allows any name."""
    if namespace is not None and call.namespace != namespace:
        return set()
    exact = as_grant(call)
    return {grant for grant in (exact, exact._replace(name="")) if grant in grants}
