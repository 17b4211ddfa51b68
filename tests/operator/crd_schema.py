"""The CRD's committed OpenAPI schema, a walk over its properties, its CEL rules, and the check that the
schema and the models refuse the same spec."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest
import yaml

from kvtune.operator.k8s.crd import KVTuningPolicySpec

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


def cel_rules() -> list[dict[str, str]]:
    """Every CEL rule of the schema (x-kubernetes-validations): its `rule`, and the `message` the API server
    refuses an object with."""
    return [rule for _, node in walk(openapi_schema()) for rule in node.get("x-kubernetes-validations", [])]


def assert_refused_by_schema_and_model(spec: dict[str, Any]) -> None:
    """A policy spec that the API server (the committed schema) and the operator (the models) both refuse."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"spec": spec}, openapi_schema())
    with pytest.raises(pydantic.ValidationError):
        KVTuningPolicySpec.model_validate(spec)
