"""scripts/build_helm4.py (what `make helm4-tools` runs): its cache moves with $KVTUNE_HELM4_DIR, a second run
is a no-op once the pinned helm is there, and without `go` it says so in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chart.helm_versions import build_helm4_script, require


def test_the_cache_moves_with_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = build_helm4_script()
    monkeypatch.setenv("KVTUNE_HELM4_DIR", str(tmp_path))
    assert script.helm4_dir() == tmp_path
    monkeypatch.delenv("KVTUNE_HELM4_DIR")
    assert script.helm4_dir() == Path.home() / ".cache" / "kvtune" / "helm" / script.VERSION


def test_a_second_run_is_a_no_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = build_helm4_script()
    built, _ = require("helm4")
    (tmp_path / "helm").symlink_to(built)
    monkeypatch.setattr(script.shutil, "which", lambda name: None)  # a build would fail: no `go`
    assert script.build(tmp_path) is None


def test_without_go_it_fails_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = build_helm4_script()
    monkeypatch.setenv("KVTUNE_HELM4_DIR", str(tmp_path / "helm"))
    monkeypatch.setenv("PATH", "")
    assert script.main([]) == 1
    error = capsys.readouterr().err
    assert error == (
        f"error: cannot build helm {script.VERSION} into {tmp_path / 'helm'}: `go` (1.26 or newer) is not on "
        f"PATH: it builds helm.sh/helm/v4@{script.VERSION}\n"
    )
    assert not (tmp_path / "helm" / "helm").exists()
