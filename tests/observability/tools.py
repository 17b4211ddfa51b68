"""The Debian binaries the observability tests run (promtool, prometheus, prometheus-alertmanager).

`make test` installs them when missing (see the Makefile); a test that needs one and does not find it FAILS
with the reason and the fix, never skips: a rule file nobody checked is exactly what this suite exists to
prevent.
"""

from __future__ import annotations

import shutil

import pytest

DEBIAN_PACKAGE = {
    "promtool": "prometheus",
    "prometheus": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager",
}


def require(binary: str) -> str:
    """The binary's path, or a test failure that says how to install it."""
    path = shutil.which(binary)
    if path is None:
        package = DEBIAN_PACKAGE[binary]
        pytest.fail(
            f"`{binary}` is not on PATH: install the Debian package `{package}` "
            f"(`make test` does: apt-get install -y --no-install-recommends {package})",
            pytrace=False,
        )
    return path
