"""The shape of `kvtune bench fleet`'s fleet, as values: which namespaces, which policies (Recommend, engine
vllm, each pod's /metrics through `target.podEndpoints`), their Deployments, selector-less Services and
EndpointSlices, and where each pod's replayed engine answers. Pure: the cluster side (fleet_cluster.py)
creates what this describes.

Each policy's pods share a metrics port of the policy's own (as a Service's pods do) and take addresses
from the pod network in turn, so every pod is one (address, port) endpoint of the replay server, and a few
hundred addresses serve thousands of pods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BASE_PORT = 20_000
POOL_LABEL = "kvtune-e2e/pool"  # the label tests/e2e/cluster.py kwok_node puts on its nodes
FLEET_LABEL = "kvtune-fleet/policy"
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class PolicyPlan:
    namespace: str
    name: str  # the policy's, its Deployment's and its Service's
    port: int  # every pod's metrics port
    recording: str  # what its pods replay
    addresses: tuple[str, ...]  # its pods', in the order of their names


@dataclass(frozen=True)
class Fleet:
    namespaces: tuple[str, ...]
    policies: tuple[PolicyPlan, ...]
    interval_s: int

    @property
    def pods(self) -> int:
        return sum(len(p.addresses) for p in self.policies)

    def endpoints(self) -> list[dict[str, object]]:
        """The replay server's endpoints: one per pod."""
        return [{"address": address, "port": policy.port, "recording": policy.recording}
                for policy in self.policies for address in policy.addresses]  # fmt: skip


def fleet(
    policies: int, pods_per_policy: int, policies_per_namespace: int, addresses: Sequence[str],
    recordings: Sequence[str], interval_s: int,
) -> Fleet:  # fmt: skip
    """P policies in ceil(P / policies_per_namespace) namespaces, each over `pods_per_policy` pods, the
    recordings dealt to the policies in turn. A policy's pods need addresses of their own (one port)."""
    if pods_per_policy > len(addresses):
        raise ValueError(f"{pods_per_policy} pods per policy, but only {len(addresses)} pod addresses")
    if policies < 1 or pods_per_policy < 1 or policies_per_namespace < 1 or not recordings:
        raise ValueError("a fleet has at least one policy, one pod per policy, one recording")
    if BASE_PORT + policies > 65_535:
        raise ValueError(f"at most {65_535 - BASE_PORT} policies: each has a port of its own")
    count = -(-policies // policies_per_namespace)
    namespaces = tuple(f"fleet-{k}" for k in range(count))
    plans = []
    for i in range(policies):
        first = i * pods_per_policy
        mine = tuple(addresses[(first + j) % len(addresses)] for j in range(pods_per_policy))
        plans.append(PolicyPlan(namespaces[i // policies_per_namespace], f"engines-{i}", BASE_PORT + i,
                                recordings[i % len(recordings)], mine))  # fmt: skip
    return Fleet(namespaces, tuple(plans), interval_s)


def deployment(plan: PolicyPlan) -> dict[str, Any]:
    """vLLM as the chart's users run it, on the fleet's kwok nodes (kwok runs no container)."""
    labels = {"app": plan.name, FLEET_LABEL: plan.name}
    args = ["--model", "/models/llama", "--port", str(plan.port), "--max-num-seqs", str(MAX_NUM_SEQS)]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": plan.name, "namespace": plan.namespace, "labels": labels},
        "spec": {"replicas": len(plan.addresses), "selector": {"matchLabels": {"app": plan.name}},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"nodeSelector": {POOL_LABEL: "fleet"},
                                       "containers": [{"name": "vllm", "image": VLLM_IMAGE, "args": args,
                                                       "ports": [{"name": "http", "containerPort": plan.port}]}]}}},
    }  # fmt: skip


def service(plan: PolicyPlan) -> dict[str, Any]:
    """A Service without a selector: its EndpointSlice is the fleet's, listing the replayed addresses."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": plan.name, "namespace": plan.namespace},
            "spec": {"ports": [{"name": "http", "port": plan.port, "protocol": "TCP"}]}}  # fmt: skip


def endpoint_slice(plan: PolicyPlan, pod_names: Sequence[str]) -> dict[str, Any]:
    """The Service's pods (by name, in order) at their replayed addresses, as the EndpointSlice controller
    would list them."""
    if len(pod_names) != len(plan.addresses):
        raise ValueError(f"{plan.name}: {len(pod_names)} pods for {len(plan.addresses)} addresses")
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{plan.name}-fleet", "namespace": plan.namespace,
                     "labels": {"kubernetes.io/service-name": plan.name,
                                "endpointslice.kubernetes.io/managed-by": "kvtune-bench-fleet"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": plan.port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "name": name, "namespace": plan.namespace}}
                      for name, address in zip(pod_names, plan.addresses, strict=True)],
    }  # fmt: skip


def policy(plan: PolicyPlan, interval_s: int, prometheus: str | None = None) -> dict[str, Any]:
    """Recommend mode: the operator reads and advises, patching nothing. Each pod's /metrics read directly
    (`target.podEndpoints`), or with `prometheus` (its URL) each pod's series from there (`byPod`, the
    pods told apart by their `pod` label, as a PodMonitor's targets carry it)."""
    target: dict[str, Any] = {"name": plan.name, "engine": "vllm", "container": "vllm"}
    spec: dict[str, Any] = {"target": target, "mode": "Recommend", "intervalSeconds": interval_s}
    if prometheus is None:
        target["podEndpoints"] = {"service": plan.name, "metricsPort": plan.port}
    else:
        selector = f'{{namespace="{plan.namespace}",pod=~"{plan.name}-.+"}}'
        spec["metrics"] = {"prometheus": {"url": prometheus, "selector": selector, "byPod": True}}
    return {"apiVersion": "kvtune.dev/v1alpha1", "kind": "KVTuningPolicy",
            "metadata": {"name": plan.name, "namespace": plan.namespace}, "spec": spec}  # fmt: skip
