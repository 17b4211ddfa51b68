"""Check that every place the version lives agrees, and build a release from a clean commit.

    python scripts/release.py check                     # the version everywhere, and a CHANGELOG entry for it
    sudo python3 scripts/release.py X.Y.Z --out DIR     # check, then the whole release into DIR (empty or new)

A release is the wheel, the chart package, the operator and proxy images as OCI archives (scripts/build_image.sh,
as root; one Debian base layer shared by both), each image's manifest digest and SBOM (SPDX JSON, by syft,
built from Go modules by scripts/build_syft.py), the release notes (CHANGELOG.md's entry) and SHA256SUMS of
all of it. The version lives in pyproject.toml, kvtune/__init__.py, the chart's `version` and `appVersion`,
the rendered rules (each runbook_url names the tag `v<version>` and a page the commit holds) and CHANGELOG.md.
A tree with uncommitted changes is refused (`--allow-dirty` is for tests: the images then say `-dirty`).
docs/releasing.md is the whole procedure.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
RULES = ("deploy/prometheus/kvtune-rules.yaml", "charts/kvtune/files/kvtune-rules.yaml")
RUNBOOK_URL = re.compile(r"runbook_url: (https://github\.com/kvtune/kvtune/blob/v([^/\s]+)/(\S+))")
IMAGES = ("operator", "proxy")
NOTES = "RELEASE_NOTES.md"
SUMS = "SHA256SUMS"


class ReleaseError(Exception):
    """Why the release stopped, printed as one line."""


def versions() -> dict[str, str]:
    """Where the version is written -> what it says there."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    package = re.search(r'^__version__ = "([^"]+)"', (REPO / "kvtune" / "__init__.py").read_text(), re.M)
    chart = (REPO / "charts" / "kvtune" / "Chart.yaml").read_text()
    chart_version = re.search(r"^version: (\S+)", chart, re.M)
    app_version = re.search(r'^appVersion: "([^"]+)"', chart, re.M)
    rules = (REPO / RULES[0]).read_text()
    tags = sorted(set(re.findall(r"/blob/v([^/]+)/docs/runbooks/", rules)))
    return {
        "pyproject.toml": pyproject,
        "kvtune/__init__.py": package.group(1) if package else "(none)",
        "charts/kvtune/Chart.yaml version": chart_version.group(1) if chart_version else "(none)",
        "charts/kvtune/Chart.yaml appVersion": app_version.group(1) if app_version else "(none)",
        "deploy/prometheus/kvtune-rules.yaml runbook tag": ",".join(tags) or "(none)",
    }


def problems() -> list[str]:
    found = versions()
    wanted = found["pyproject.toml"]
    lines = [
        f"{where} says {value}, pyproject.toml {wanted}" for where, value in found.items() if value != wanted
    ]
    if not re.search(rf"^## {re.escape(wanted)}\b", (REPO / "CHANGELOG.md").read_text(), re.M):
        lines.append(f"CHANGELOG.md has no '## {wanted}' entry")
    return lines


def runbook_urls(rules_text: str) -> list[tuple[str, str, str]]:
    """(url, the tag's version, the path in the repository) of every runbook_url in a rules file."""
    return RUNBOOK_URL.findall(rules_text)


def unresolved_runbooks(version: str) -> list[str]:
    """Every runbook_url of the rendered rules (deploy/ and the chart's copy) that names another version, or a
    page the tree lacks: once the tag is pushed, each must open that version's page (a clean tree has every
    page committed)."""
    lines = []
    for rules in RULES:
        urls = runbook_urls((REPO / rules).read_text())
        if not urls:
            lines.append(f"{rules} has no runbook_url")
        for url, tag, path in urls:
            if tag != version:
                lines.append(f"{rules}: {url} names v{tag}, not v{version}")
            elif not (REPO / path).is_file():
                lines.append(f"{rules}: {url} names {path}, which is not in the tree")
    return lines


def changelog_entry(version: str) -> str:
    """CHANGELOG.md's `## VERSION` entry, its heading included, up to the next version's."""
    text = (REPO / "CHANGELOG.md").read_text()
    found = re.search(rf"^## {re.escape(version)}\b.*?(?=^## |\Z)", text, re.M | re.S)
    if found is None:
        raise ReleaseError(f"CHANGELOG.md has no '## {version}' entry")
    return found.group(0).rstrip() + "\n"


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise ReleaseError(f"`git {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def uncommitted() -> list[str]:
    """Paths with changes not in HEAD (untracked ones too, unless ignored)."""
    return [line[3:] for line in git("status", "--porcelain").splitlines() if line.strip()]


def run(*argv: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise ReleaseError(f"`{' '.join(argv)}` exited {done.returncode}")


def script(name: str) -> ModuleType:
    """A sibling script (build_syft.py, install_helm.py) as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def helm() -> str:
    """helm on PATH or in .venv/bin (`make helm-tools`), else installed into ~/.cache/kvtune/release-tools."""
    for found in (shutil.which("helm"), REPO / ".venv" / "bin" / "helm"):
        if found is not None and Path(found).is_file():
            return str(found)
    tools = Path.home() / ".cache" / "kvtune" / "release-tools"
    if script("install_helm").main([str(tools)]) != 0:
        raise ReleaseError("helm is not installed and could not be (scripts/install_helm.py)")
    return str(tools / "helm")


def syft() -> str:
    """syft at the pinned version, built once per machine (scripts/build_syft.py)."""
    builder = script("build_syft")
    try:
        builder.build(builder.syft_dir())
    except builder.BuildError as err:
        raise ReleaseError(f"cannot build syft {builder.VERSION}: {err}") from None
    return str(builder.syft_dir() / "syft")


def manifest_digest(archive: Path) -> str:
    """The digest of the image manifest an OCI archive holds: what a registry shows once it is copied there."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            raise ReleaseError(f"{archive.name} has no index.json")
        (manifest,) = json.load(member)["manifests"]
    digest: str = manifest["digest"]
    return digest


def build_images(version: str, out: Path, cache: Path) -> dict[str, Path]:
    """The operator and proxy images (scripts/build_image.sh), sharing the base layers kept in `cache`;
    checks the digest each build wrote against its archive."""
    archives = {}
    for kind in IMAGES:
        run("bash", str(REPO / "scripts" / "build_image.sh"), kind, "--out", str(out), "--cache", str(cache),
            env={"PYTHON": sys.executable})  # fmt: skip
        archive = out / f"kvtune-{kind}-{version}.oci.tar"
        written = (out / f"kvtune-{kind}-{version}.digest").read_text().strip()
        if manifest_digest(archive) != written:
            raise ReleaseError(
                f"{archive.name}: its manifest is {manifest_digest(archive)}, the build said {written}"
            )
        archives[kind] = archive
    return archives


def sbom(syft_binary: str, archive: Path, name: str, version: str) -> Path:
    """An SPDX JSON SBOM of the image: Debian's packages and the Python packages of /opt/kvtune."""
    target = archive.parent / f"{name}-{version}.spdx.json"
    run(syft_binary, "scan", f"oci-archive:{archive}", "--quiet", "--source-name", name, "--source-version",
        version, "-o", f"spdx-json={target}", env={"SYFT_CHECK_FOR_APP_UPDATE": "false"})  # fmt: skip
    return target


def checksums(out: Path) -> Path:
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != SUMS)
    lines = []
    for path in files:
        digest = hashlib.sha256()
        with path.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
        lines.append(f"{digest.hexdigest()}  {path.name}\n")
    (out / SUMS).write_text("".join(lines))
    return out / SUMS


def release(
    version: str, out: Path, allow_dirty: bool = False, image_cache: Path | None = None
) -> list[Path]:
    """Everything a release publishes, into `out` (which must be empty or absent)."""
    found = problems()
    if found:
        raise ReleaseError("; ".join(found))
    carried = versions()["pyproject.toml"]
    if version != carried:
        raise ReleaseError(
            f"the tree carries version {carried}, not {version}: bump it first (docs/releasing.md)"
        )
    dirty = uncommitted()
    if dirty and not allow_dirty:
        raise ReleaseError(
            f"uncommitted changes ({len(dirty)} paths, first {dirty[0]}): release from a clean commit"
        )
    unresolved = unresolved_runbooks(version)
    if unresolved:
        raise ReleaseError("; ".join(unresolved))
    if os.geteuid() != 0:
        raise ReleaseError("the images need root (debootstrap and chroot): run it with sudo")
    if out.exists() and any(out.iterdir()):
        raise ReleaseError(f"{out} is not empty: a release goes into an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    syft_binary = syft()  # built first: a machine that cannot build it fails before the slow part
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(REPO))
    run(helm(), "package", str(REPO / "charts" / "kvtune"), "--destination", str(out))
    with tempfile.TemporaryDirectory(prefix="kvtune-release-") as scratch:
        archives = build_images(version, out, image_cache or Path(scratch))
    for kind, archive in archives.items():
        sbom(syft_binary, archive, f"kvtune-{kind}", version)
    (out / NOTES).write_text(changelog_entry(version))
    checksums(out)
    return sorted(out.iterdir())


def parse(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["check"]:
        return argparse.Namespace(action="check")
    parser = argparse.ArgumentParser(
        prog="release.py", description=__doc__.split("\n\n")[0], usage="%(prog)s check | VERSION --out DIR"
    )
    parser.add_argument("version", metavar="VERSION", help="the version the tree carries, e.g. 0.1.0")
    parser.add_argument("--out", type=Path, required=True, help="an empty or new folder for the release")
    parser.add_argument(
        "--allow-dirty", action="store_true", help="for tests: build from uncommitted changes"
    )
    parser.add_argument(
        "--image-cache",
        type=Path,
        help="keep the images' Debian and dependency layers here between runs (default: built afresh)",
    )
    args = parser.parse_args(argv)
    args.action = "release"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        if args.action == "check":
            found = problems()
            if found:
                raise ReleaseError("; ".join(found))
            print(
                f"version {versions()['pyproject.toml']}: pyproject, package, chart, rules and CHANGELOG agree"
            )
            return 0
        for path in release(args.version, args.out.resolve(), args.allow_dirty, args.image_cache):
            print(path)
    except ReleaseError as err:
        print(f"release: error: {err}", file=sys.stderr)
        return 1
    print(f"next: git tag -a v{args.version} -m 'kvtune {args.version}' && git push origin v{args.version} "
          "(docs/releasing.md)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
