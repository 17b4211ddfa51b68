"""A missing Prometheus binary fails the test that needs it, naming the Debian package: never a skip."""

from __future__ import annotations

import pytest

from tests.observability.tools import require


def test_missing_binary_fails_with_the_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(pytest.fail.Exception) as failed:
        require("prometheus-alertmanager")
    message = str(failed.value)
    assert "`prometheus-alertmanager` is not on PATH" in message
    assert "apt-get install -y --no-install-recommends prometheus-alertmanager" in message


def test_present_binary_is_found() -> None:
    assert require("promtool").endswith("/promtool")
