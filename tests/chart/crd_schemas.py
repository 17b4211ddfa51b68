"""The schemas custom resources are checked against: each CRD the chart ships and the Prometheus Operator's
whose objects it renders, closed to unknown fields the way the API server's pruning would drop them."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from tests.chart.helm import CHART
from tests.chart.monitoring_crds import monitoring_crds

CRD_FILES = sorted((CHART / "crds").glob("*.yaml"))


def chart_crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the openAPIV3Schema of each CRD the chart ships, and of the Prometheus
    Operator's whose objects it renders."""
    crds = [crd for path in CRD_FILES for crd in yaml.safe_load_all(path.read_text())] + monitoring_crds()
    schemas = {}
    for crd in crds:
        for version in crd["spec"]["versions"]:
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused wherever it lists properties, as pruning would drop them.
    apiVersion, kind and metadata are allowed at the root of every custom resource, listed or not."""
    schema = copy.deepcopy(schema)
    for implicit in ("apiVersion", "kind"):
        schema.setdefault("properties", {}).setdefault(implicit, {"type": "string"})
    schema["properties"].setdefault("metadata", {"type": "object"})

    def close(node: dict[str, Any]) -> None:
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        for child in node.get("properties", {}).values():
            close(child)
        if isinstance(node.get("items"), dict):
            close(node["items"])

    close(schema)
    return schema
