"""The matrix of installs every rendered object is checked over (the issue's, plus two more)."""

from __future__ import annotations

import yaml

from tests.chart.helm import MONITORING_API, REPO

ENGINE_IMAGE = "registry.example.com/platform/kvtune-engine"
PROXY_IMAGE = "registry.example.com/platform/kvtune-proxy"
ENGINE_ON = {"examples": {"kvtuneEngine": {"enabled": True, "image": {"repository": ENGINE_IMAGE}}}}
VLLM_PROXY_ON = {
    "examples": {
        "vllmProxy": {
            "enabled": True,
            "modelClaimName": "llama-weights",
            "vllmImage": {"tag": "v0.11.0"},
            "proxyImage": {"repository": PROXY_IMAGE},
        }
    }
}
# The PodMonitor for a vLLM Deployment with the kvtune proxy in each pod (the README's install matrix).
POD_MONITOR_ON = {
    "monitoring": {
        "podMonitor": {
            "enabled": True,
            "selector": {"matchLabels": {"app": "llama-vllm"}},
            "proxyPort": "proxy",
        }
    }
}

# The values of each layout docs/install.md names (plain vLLM, production-stack, KServe, llm-d, kvtune's engine).
LAYOUTS = {path.stem: path for path in sorted((REPO / "deploy" / "layouts").glob("*.yaml"))}


def layout(name: str) -> dict[str, object]:
    values: dict[str, object] = yaml.safe_load(LAYOUTS[name].read_text())
    return values


# name -> (values, --api-versions): the matrix, plus forced monitoring and two watched namespaces.
MATRIX: dict[str, tuple[dict[str, object], tuple[str, ...]]] = {
    "default": ({}, ()),
    "monitoring-crds-present": ({}, (MONITORING_API,)),
    "monitoring-forced-without-crds": ({"monitoring": {"force": True}}, ()),
    "cluster-wide": ({"clusterWide": True}, (MONITORING_API,)),
    "two-watched-namespaces": (
        {"watchNamespaces": ["team-a", "team-b"], "adminTokenSecrets": ["llama-admin-token"]},
        (),
    ),
    "example-engine": (ENGINE_ON, (MONITORING_API,)),
    "example-vllm-proxy": (VLLM_PROXY_ON, (MONITORING_API,)),
    "two-replicas": ({"replicas": 2}, ()),
    "pod-monitor": (POD_MONITOR_ON, (MONITORING_API,)),
    "pod-monitor-cluster-wide": ({**POD_MONITOR_ON, "clusterWide": True}, (MONITORING_API,)),
    "apply-allowed-with-uninstall-hook": (
        {"maxMode": "Apply", "uninstall": {"deletePolicies": True}, "watchNamespaces": ["inference"]},
        (MONITORING_API,),
    ),
    **{f"layout-{name}": (layout(name), (MONITORING_API,)) for name in LAYOUTS},
}
