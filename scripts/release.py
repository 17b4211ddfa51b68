"""Build a release's artifacts into dist/ after checking that every place the version lives agrees.

    python scripts/release.py check            # the version everywhere, and a CHANGELOG entry for it
    python scripts/release.py build [--out dist]   # check, then the wheel, the packaged chart, SHA256SUMS

The version lives in pyproject.toml, kvtune/__init__.py, the chart's `version` and `appVersion`, the
rendered rules (each runbook_url names the tag `v<version>`) and CHANGELOG.md. The images are built apart
(`scripts/build_image.sh`, as root); docs/releasing.md is the whole procedure.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def versions() -> dict[str, str]:
    """Where the version is written -> what it says there."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    package = re.search(r'^__version__ = "([^"]+)"', (REPO / "kvtune" / "__init__.py").read_text(), re.M)
    chart = (REPO / "charts" / "kvtune" / "Chart.yaml").read_text()
    chart_version = re.search(r"^version: (\S+)", chart, re.M)
    app_version = re.search(r'^appVersion: "([^"]+)"', chart, re.M)
    rules = (REPO / "deploy" / "prometheus" / "kvtune-rules.yaml").read_text()
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


def run(*argv: str) -> None:
    done = subprocess.run(argv, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"release: error: {' '.join(argv)} exited {done.returncode}")


def build(out: Path) -> list[Path]:
    helm = shutil.which("helm") or str(REPO / ".venv" / "bin" / "helm")
    out.mkdir(parents=True, exist_ok=True)
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(REPO))
    run(helm, "package", str(REPO / "charts" / "kvtune"), "--destination", str(out))
    version = versions()["pyproject.toml"]
    artifacts = sorted(out.glob(f"kvtune-{version}*"))
    sums = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in artifacts)
    (out / "SHA256SUMS").write_text(sums)
    return [*artifacts, out / "SHA256SUMS"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("check", help="the version everywhere, and a CHANGELOG entry for it")
    build_parser = actions.add_parser("build", help="check, then build the wheel and the chart into --out")
    build_parser.add_argument("--out", type=Path, default=REPO / "dist")
    args = parser.parse_args(argv)
    found = problems()
    if found:
        for line in found:
            print(f"release: error: {line}", file=sys.stderr)
        return 1
    version = versions()["pyproject.toml"]
    print(f"version {version}: pyproject, package, chart, rules and CHANGELOG agree")
    if args.action == "build":
        for path in build(args.out):
            print(path)
        print(
            f"next: git tag -a v{version} -m 'kvtune {version}' && git push origin v{version} (docs/releasing.md)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
