"""The Prometheus Operator's own CRDs (ServiceMonitor, PodMonitor, PrometheusRule), so the chart's monitoring
objects are checked against the schema the API server would enforce, not against our idea of it.

They come from the prometheus-operator Go module at a pinned release (its example/prometheus-operator-crd/
folder), fetched with `go mod download` through the Go module proxy into Go's module cache: the machines
have Go and the proxy, and nothing else serves these files. Without Go the tests fail with the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

MODULE = "github.com/prometheus-operator/prometheus-operator"
VERSION = "v0.81.0"  # the release the supported-versions table names
KINDS = ("servicemonitors", "podmonitors", "prometheusrules")


@cache
def crd_folder() -> Path:
    """The module's CRD folder in Go's module cache (downloaded once)."""
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").is_file() else None)
    if go is None:
        pytest.fail(
            "`go` is not on PATH: the Prometheus Operator's CRDs come from its Go module", pytrace=False
        )
    done = subprocess.run(
        [go, "mod", "download", "-json", f"{MODULE}@{VERSION}"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
        cwd=Path(__file__).parent,
    )
    if done.returncode != 0:
        pytest.fail(f"go mod download {MODULE}@{VERSION} failed: {done.stdout}{done.stderr}", pytrace=False)
    return Path(json.loads(done.stdout)["Dir"]) / "example" / "prometheus-operator-crd"


def monitoring_crds() -> list[dict[str, Any]]:
    """The three CustomResourceDefinitions, as the API server takes them."""
    return [
        yaml.safe_load((crd_folder() / f"monitoring.coreos.com_{kind}.yaml").read_text()) for kind in KINDS
    ]
