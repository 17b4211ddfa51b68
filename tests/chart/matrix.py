"""The matrix of installs every rendered object is checked over (the issue's, plus two more)."""

from __future__ import annotations

from tests.chart.helm import MONITORING_API

ENGINE_ON = {"examples": {"kvtuneEngine": {"enabled": True}}}
VLLM_PROXY_ON = {"examples": {"vllmProxy": {"enabled": True, "modelClaimName": "llama-weights"}}}

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
}
