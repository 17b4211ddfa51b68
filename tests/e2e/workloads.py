"""Workloads and policies the e2e tests create: a vLLM-style Deployment (its pods run under kwok, which has
no container runtime), the Service and EndpointSlices that point the operator at real engines in the run's
pod network, and a preempting load on those engines."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtune.harness.load import BackgroundLoad, LoadShape
from kvtune.harness.server import ServerProcess

POOL_LABEL = "kvtune-e2e/pool"
ADMIN_TOKEN = "e2e-admin-token"
KV_CACHE_TOKENS = 512  # the engines' small pools: a few clients preempt
MAX_NUM_SEQS = 32  # the pool's 32 blocks: the most the admin API takes back after a test lowered it
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
VLLM_ARGS = [
    "--model",
    "/models/llama",
    "--port",
    "8000",
    "--max-num-seqs",
    "64",
    "--max-num-active-seqs",
    "64",
]
LOAD = LoadShape(
    clients=6, prompt_len=(40, 60), output_len=(60, 100)
)  # per engine: preempts a 512-token pool


def vllm_deployment(
    name: str, namespace: str, pool: str, replicas: int = 3, progress_deadline_s: int | None = None,
    args: list[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """vLLM with its admission flags, and a second container (a log shipper) the operator must not touch.
    Its pods run on the kwok nodes of `pool`; a rolling update adds one pod at a time, removing none early."""
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": {"app": name}},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {
            "metadata": {"labels": {"app": name}},
            "spec": {
                "nodeSelector": {POOL_LABEL: pool},
                "containers": [
                    {"name": "vllm", "image": VLLM_IMAGE, "args": list(args or VLLM_ARGS),
                     "ports": [{"name": "http", "containerPort": 8000}],
                     "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
                    {"name": "log-shipper", "image": "fluent/fluent-bit:3.2",
                     "args": ["--config", "/fluent-bit/etc/fluent-bit.conf"]},
                ],
            },
        },
    }  # fmt: skip
    if progress_deadline_s is not None:
        spec["progressDeadlineSeconds"] = progress_deadline_s
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}}, "spec": spec}  # fmt: skip


def pods_policy(name: str, namespace: str, workload: str, service: str, port: int, engine: str = "vllm",
                **extra: Any) -> dict[str, Any]:  # fmt: skip
    """A KVTuningPolicy over every pod of the workload's Service, in Apply mode, sampled every second. The
    evaluation window is long: a test sees one action and what follows it, not the tuner's next steps."""
    target: dict[str, Any] = {"name": workload, "engine": engine,
                              "podEndpoints": {"service": service, "metricsPort": port}}  # fmt: skip
    if engine == "vllm":
        target["container"] = "vllm"
    return {
        "apiVersion": "kvtune.dev/v1alpha1",
        "kind": "KVTuningPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"target": {**target, **extra}, "mode": "Apply", "bounds": {"minMaxNumSeqs": 2, "maxMaxNumSeqs": 256},
                 "intervalSeconds": 1, "evaluationWindowSeconds": 600, "cooldownSeconds": 0},
    }  # fmt: skip


@contextmanager
def preempting_load(engines: list[ServerProcess]) -> Iterator[list[BackgroundLoad]]:
    """A closed-loop load on each engine, enough to preempt at max_num_seqs 64 on a 512-token pool."""
    loads = [BackgroundLoad(engine.url, LOAD).start() for engine in engines]
    try:
        yield loads
    finally:
        for load in loads:
            load.stop()


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def args_owner_managers(workload: dict[str, Any], name: str = "vllm") -> list[str]:
    """The field managers owning the container's args, as managedFields says."""
    key = 'k:{"name":"' + name + '"}'
    found = []
    for entry in workload["metadata"].get("managedFields") or []:
        fields = entry.get("fieldsV1") or {}
        for step in ("f:spec", "f:template", "f:spec", "f:containers", key):
            fields = fields.get(step) or {}
        if "f:args" in fields:
            found.append(f"{entry['manager']}/{entry['operation']}")
    return found


def engine_port(engines: list[ServerProcess]) -> int:
    return int(engines[0].url.rsplit(":", 1)[1])


def endpoint_slice(namespace: str, service: str, port: int, pods: dict[str, str]) -> dict[str, object]:
    """An EndpointSlice of `service` listing `pods` (name -> address), as the EndpointSlice controller would."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": f"{service}-e2e", "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service,
                                "endpointslice.kubernetes.io/managed-by": "kvtune-e2e"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "name": name, "namespace": namespace}}
                      for name, address in sorted(pods.items())],
    }  # fmt: skip


def service(namespace: str, name: str, port: int) -> dict[str, object]:
    """A Service without a selector: its EndpointSlices are the test's (the engines run outside the cluster)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
            "spec": {"ports": [{"name": "http", "port": port, "protocol": "TCP"}]}}  # fmt: skip
