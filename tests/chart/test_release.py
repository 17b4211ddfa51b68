"""The release procedure's checks (scripts/release.py, docs/releasing.md): the version agrees wherever it
is written (package, chart, the rules' runbook tag) and CHANGELOG.md has its entry; a disagreement is named;
`helm package` makes the chart archive a release publishes, and that archive renders; every runbook_url in
the rules, the packaged chart's copy included, opens a runbook page of this version; LICENSE is the
Apache-2.0 text pyproject.toml declares. A dirty tree or another version is refused in one line. The
release `make release-artifacts` built from this tree (tests/chart/release_build.py) holds everything it
lists: its checksums verify, each image archive's manifest is the digest written beside it, the two images
share their Debian layer, run kvtune as user 65532, and have SBOMs that name kvtune's packages and
Debian's."""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.chart.helm import BASE_VALUES, CHART, REPO, helm
from tests.chart.release_build import artifact, built_release, digest
from tests.repo_scripts import load_script

# The Apache License 2.0 text as Debian ships it (/usr/share/common-licenses/Apache-2.0), byte for byte.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def release_script() -> ModuleType:
    return load_script("release")


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


def test_every_runbook_url_of_the_packaged_rules_opens_a_runbook_of_this_version(tmp_path: Path) -> None:
    release = release_script()
    version = release.versions()["pyproject.toml"]
    assert release.unresolved_runbooks(version) == []
    done = helm("package", CHART, "--destination", tmp_path)
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / f"kvtune-{version}.tgz") as tar:
        rules = yaml.safe_load(tar.extractfile("kvtune/files/kvtune-rules.yaml"))
    alerts = [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    assert alerts
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        page = f"docs/runbooks/{alert['alert']}.md"
        assert url == f"https://github.com/kvtune/kvtune/blob/v{version}/{page}", url
        assert (REPO / page).is_file(), f"{url}: {page} is not in the tree"


def test_a_dirty_tree_or_another_version_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    release = release_script()
    version = release.versions()["pyproject.toml"]
    monkeypatch.setattr(release, "uncommitted", lambda: ["kvtune/cli.py", "README.md"])
    assert release.main([version, "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == (
        "release: error: uncommitted changes (2 paths, first kvtune/cli.py): release from a clean commit\n"
    )
    assert release.main(["9.9.9", "--out", str(tmp_path / "out"), "--allow-dirty"]) == 1
    assert capsys.readouterr().err == (
        f"release: error: the tree carries version {version}, not 9.9.9: bump it first (docs/releasing.md)\n"
    )
    assert not (tmp_path / "out").exists()


def test_the_release_notes_are_the_changelog_entry() -> None:
    release = release_script()
    version = release.versions()["pyproject.toml"]
    notes = release.changelog_entry(version)
    assert notes.startswith(f"## {version}") and notes in (REPO / "CHANGELOG.md").read_text()
    assert not re.search(r"^## \d", notes.split("\n", 1)[1], re.M)  # no other version's entry


def blob(tar: tarfile.TarFile, digest_: str) -> dict[str, Any]:
    member = tar.extractfile(f"blobs/{digest_.replace(':', '/')}")
    assert member is not None, digest_
    found: dict[str, Any] = json.load(member)
    return found


def image_manifest(archive: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """An OCI archive's index, its one manifest and that manifest's image configuration."""
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        (entry,) = index["manifests"]
        manifest = blob(tar, entry["digest"])
        return index, manifest, blob(tar, manifest["config"]["digest"])


def test_the_built_release_holds_every_artifact_and_its_checksums_verify() -> None:
    release = built_release()
    version = release_script().versions()["pyproject.toml"]
    names = {path.name for path in release.iterdir()}
    images = {f"kvtune-{kind}-{version}{suffix}" for kind in ("operator", "proxy")
              for suffix in (".oci.tar", ".digest", ".spdx.json", ".requirements.lock")}  # fmt: skip
    assert names == {f"kvtune-{version}.tgz", f"kvtune-{version}-py3-none-any.whl", "RELEASE_NOTES.md",
                     "SHA256SUMS", *images}  # fmt: skip
    sums = {}
    for line in (release / "SHA256SUMS").read_text().splitlines():
        checksum, name = line.split("  ", 1)
        sums[name] = checksum
    assert set(sums) == names - {"SHA256SUMS"}
    for name, expected in sums.items():
        assert hashlib.sha256((release / name).read_bytes()).hexdigest() == expected, name
    assert artifact("notes").read_text() == release_script().changelog_entry(version)
    with tarfile.open(artifact("chart")) as tar:
        chart = yaml.safe_load(tar.extractfile("kvtune/Chart.yaml"))
    assert (chart["version"], chart["appVersion"]) == (version, version)


def test_each_image_is_pinned_by_its_manifest_digest_and_runs_kvtune_as_65532() -> None:
    version = release_script().versions()["pyproject.toml"]
    layers = {}
    for kind in ("operator", "proxy"):
        index, manifest, image = image_manifest(artifact(kind))
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest(kind)), digest(kind)
        assert index["manifests"][0]["digest"] == digest(kind)
        assert (
            index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
            == f"kvtune-{kind}:{version}"
        )
        config = image["config"]
        assert (config["User"], config["Entrypoint"], config["Cmd"]) == ("65532:65532", ["kvtune"], [kind])
        assert config["Labels"]["org.opencontainers.image.version"] == version
        layers[kind] = [layer["digest"] for layer in manifest["layers"]]
        assert len(layers[kind]) == 3, manifest["layers"]  # Debian, the dependencies, kvtune
    assert layers["operator"][0] == layers["proxy"][0]  # one Debian base under both


def normalized(name: str) -> str:
    """A package name as PEP 503 compares them (pip lists prometheus_client, syft prometheus-client)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sbom_packages(kind: str) -> dict[str, set[str]]:
    """The SBOM's packages, name (normalized) -> versions; it must be syft's SPDX 2.3."""
    sbom = json.loads(artifact(f"{kind}.sbom").read_text())
    assert sbom["spdxVersion"] == "SPDX-2.3", sbom["spdxVersion"]
    creators = sbom["creationInfo"]["creators"]
    assert any(creator.startswith("Tool: syft-") for creator in creators), creators
    found: dict[str, set[str]] = {}
    for package in sbom["packages"]:
        found.setdefault(normalized(package["name"]), set()).add(package.get("versionInfo", ""))
    return found


def test_each_sbom_names_kvtune_its_python_packages_and_debians() -> None:
    version = release_script().versions()["pyproject.toml"]
    for kind, dependency in (("operator", "kopf"), ("proxy", "uvicorn")):
        packages = sbom_packages(kind)
        assert version in packages.get("kvtune", set()), sorted(packages)
        assert dependency in packages and "python3-11" in packages, sorted(packages)  # from pip and from dpkg
        assert "torch" not in packages, kind
        locked = artifact(kind).with_name(f"kvtune-{kind}-{version}.requirements.lock").read_text()
        for line in locked.splitlines():  # every package the image's pip lists is in its SBOM
            name, _, pinned = line.partition("==")
            assert pinned in packages.get(normalized(name), set()), line


def test_the_licence_file_is_the_apache_2_text_pyproject_declares() -> None:
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text()
    assert hashlib.sha256((REPO / "LICENSE").read_bytes()).hexdigest() == APACHE_2_SHA256
