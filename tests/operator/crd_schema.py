"""The CRD's committed OpenAPI schema and a walk over its properties."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


CRD_FILE = ROOT / "charts" / "kvtune" / "crds" / "kvtuningpolicy.yaml"


def committed_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def openapi_schema() -> dict[str, Any]:
    return committed_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = "$"):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")
