"""The binaries the observability tests run: promtool from Debian's `prometheus` package (the rules' unit
tests), and the Prometheus 3 and Alertmanager users run, built from Go modules by
scripts/local_monitoring.py into its cache.

`make test` installs and builds them when missing (see the Makefile); a test that needs one and does not
find it FAILS with the reason and the fix, never skips: a rule file nobody checked is exactly what this
suite exists to prevent.
"""

from __future__ import annotations

import os
import shutil
from types import ModuleType

import pytest

DEBIAN_PACKAGE = {"promtool": "prometheus"}
BUILT = ("prometheus", "alertmanager")  # by scripts/local_monitoring.py, at the versions it pins


def local_monitoring() -> ModuleType:
    """scripts/local_monitoring.py, as scripts/local_cluster.py loads it."""
    from tests.e2e.cluster import local_cluster

    module: ModuleType = local_cluster().monitoring_stack()
    return module


def require(binary: str) -> str:
    """The binary's path, or a test failure that says how to install or build it."""
    if binary in BUILT:
        monitoring = local_monitoring()
        path = monitoring.monbins_dir() / binary
        if not os.access(path, os.X_OK) or binary in monitoring.missing(path.parent):
            pytest.fail(
                f"`{binary}` ({monitoring.PROMETHEUS_VERSION if binary == 'prometheus' else monitoring.ALERTMANAGER_VERSION}) "
                f"is not built in {path.parent}: run `make monitoring-tools` (python3 scripts/local_monitoring.py "
                "build, from the Go module proxy, once per machine), which `make test` does",
                pytrace=False,
            )
        return str(path)
    path = shutil.which(binary)
    if path is None:
        package = DEBIAN_PACKAGE[binary]
        pytest.fail(
            f"`{binary}` is not on PATH: install the Debian package `{package}` "
            f"(`make test` does: apt-get install -y --no-install-recommends {package})",
            pytrace=False,
        )
    return path
