"""The release procedure's checks (scripts/release.py, docs/releasing.md): the version agrees wherever it
is written (package, chart, the rules' runbook tag) and CHANGELOG.md has its entry; a disagreement is named;
`helm package` makes the chart archive a release publishes, and that archive renders; LICENSE is the
Apache-2.0 text pyproject.toml declares."""

from __future__ import annotations

import hashlib
import importlib.util
import tarfile
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.chart.helm import BASE_VALUES, CHART, REPO, helm

# The Apache License 2.0 text as Debian ships it (/usr/share/common-licenses/Apache-2.0), byte for byte.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def release_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("release", REPO / "scripts" / "release.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_version_agrees_everywhere_and_has_a_changelog_entry() -> None:
    release = release_script()
    assert release.problems() == []
    assert len(set(release.versions().values())) == 1


def test_a_version_that_disagrees_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    release = release_script()
    found = {**release.versions(), "charts/kvtune/Chart.yaml appVersion": "9.9.9"}
    monkeypatch.setattr(release, "versions", lambda: found)
    assert release.problems() == [
        f"charts/kvtune/Chart.yaml appVersion says 9.9.9, pyproject.toml {found['pyproject.toml']}"
    ]


def test_the_packaged_chart_is_the_release_and_renders(tmp_path: Path) -> None:
    done = helm("package", CHART, "--destination", tmp_path)
    assert done.returncode == 0, done.stderr
    version = release_script().versions()["pyproject.toml"]
    (archive,) = tmp_path.glob("*.tgz")
    assert archive.name == f"kvtune-{version}.tgz"
    with tarfile.open(archive) as tar:
        chart = yaml.safe_load(tar.extractfile("kvtune/Chart.yaml").read())  # type: ignore[union-attr]
        names = tar.getnames()
    assert (chart["version"], chart["appVersion"]) == (version, version)
    assert "kvtune/crds/kvtuningpolicy.yaml" in names and "kvtune/files/kvtune-rules.yaml" in names
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(BASE_VALUES))
    rendered = helm("template", "kvtune", archive, "--namespace", "kvtune-system", "-f", values)
    assert rendered.returncode == 0, rendered.stderr


def test_the_licence_file_is_the_apache_2_text_pyproject_declares() -> None:
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text()
    assert hashlib.sha256((REPO / "LICENSE").read_bytes()).hexdigest() == APACHE_2_SHA256
