"""helm for the chart tests: found on PATH, beside the running Python (`make helm-tools` installs it into
.venv/bin) or in the repository's .venv/bin; rendering the chart into a list of objects.

Without helm a test FAILS with the fix, never skips: an unrendered chart is exactly what these tests exist
to prevent.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvtune"
RELEASE = "kvtune"
NAMESPACE = "kvtune-system"
MONITORING_API = "monitoring.coreos.com/v1"
# Nothing publishes kvtune's images, so the chart requires the operator's repository (the README's install
# sets it after the build and push); the tests render with one unless they test its absence.
OPERATOR_IMAGE = "registry.example.com/platform/kvtune-operator"
BASE_VALUES: dict[str, Any] = {"image": {"repository": OPERATOR_IMAGE}}


def merged(base: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """`values` over `base`, maps merged key by key (as helm merges -f files)."""
    out = dict(base)
    for key, value in values.items():
        out[key] = (
            merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def find_helm() -> str | None:
    candidates = [shutil.which("helm"), Path(sys.executable).parent / "helm", REPO / ".venv" / "bin" / "helm"]
    for candidate in candidates:
        if candidate is not None and Path(candidate).is_file():
            return str(candidate)
    return None


def require_helm() -> str:
    """helm's path, or a test failure that says how to install it."""
    path = find_helm()
    if path is None:
        pytest.fail(
            "`helm` is not on PATH, beside this Python, nor in .venv/bin: run `make helm-tools` "
            "(python scripts/install_helm.py .venv/bin), which `make test` does",
            pytrace=False,
        )
    return path


def helm(*args: str | Path, binary: str | None = None) -> subprocess.CompletedProcess[str]:
    """`helm ARGS`, with the `helm` found above unless `binary` names another (tests/chart/helm_versions.py)."""
    return subprocess.run(
        [binary or require_helm(), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def template(
    values: dict[str, Any],
    tmp_path: Path,
    api_versions: tuple[str, ...] = (),
    bare: bool = False,
    binary: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart with these values (written to a file, as users pass them), over
    BASE_VALUES unless `bare`."""
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values if bare else merged(BASE_VALUES, values)))
    extra = [arg for api in api_versions for arg in ("--api-versions", api)]
    return helm(
        "template", RELEASE, CHART, "--namespace", NAMESPACE, "-f", values_file, *extra, binary=binary
    )


def render(
    values: dict[str, Any], tmp_path: Path, api_versions: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The objects `helm template` renders; a failed render fails the test with helm's message."""
    done = template(values, tmp_path, api_versions)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]
