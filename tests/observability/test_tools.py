"""A missing binary fails the test that needs it with the fix (the Debian package, or the build command):
never a skip."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.observability.tools import local_monitoring, require


def test_missing_promtool_fails_with_the_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(pytest.fail.Exception) as failed:
        require("promtool")
    message = str(failed.value)
    assert "`promtool` is not on PATH" in message
    assert "apt-get install -y --no-install-recommends prometheus" in message


def test_an_unbuilt_prometheus_fails_with_the_build_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVTUNE_MONBINS_DIR", str(tmp_path))
    with pytest.raises(pytest.fail.Exception) as failed:
        require("prometheus")
    assert "make monitoring-tools" in str(failed.value)


def test_the_built_prometheus_is_prometheus_3_with_its_version_stamped() -> None:
    """The build sets the version (else buildinfo reports an empty one), and it is the pinned 3.x."""
    done = subprocess.run([require("prometheus"), "--version"], capture_output=True, text=True, timeout=30)
    assert f"version {local_monitoring().PROMETHEUS_VERSION}" in done.stdout + done.stderr
    assert local_monitoring().PROMETHEUS_VERSION.startswith("3.")


def test_present_promtool_is_found() -> None:
    assert require("promtool").endswith("/promtool")
