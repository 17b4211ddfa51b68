"""The release `make release-artifacts` builds from this tree before the tests run (scripts/release.py
VERSION --out build/release --allow-dirty): the tests read it, and the e2e tests install and run it. A run
without it fails naming the command, never skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RELEASE_DIR = Path(os.environ.get("KVTUNE_RELEASE_DIR") or REPO / "build" / "release")


def version() -> str:
    return str(yaml.safe_load((REPO / "charts" / "kvtune" / "Chart.yaml").read_text())["appVersion"])


def built_release() -> Path:
    """The release folder, with its SHA256SUMS (written last: a release cut short has none)."""
    if not (RELEASE_DIR / "SHA256SUMS").is_file():
        pytest.fail(f"no release in {RELEASE_DIR}: run `make release-artifacts` (as root: the images need "
                    "debootstrap and chroot; the first build takes minutes), which `make test` does",
                    pytrace=False)  # fmt: skip
    return RELEASE_DIR


def artifact(kind: str) -> Path:
    """One file of the release: `chart`, `operator`/`proxy` (the image archives), `<image>.digest`, ..."""
    release, v = built_release(), version()
    names = {
        "chart": f"kvtune-{v}.tgz",
        "wheel": f"kvtune-{v}-py3-none-any.whl",
        "notes": "RELEASE_NOTES.md",
        **{image: f"kvtune-{image}-{v}.oci.tar" for image in ("operator", "proxy")},
        **{f"{image}.digest": f"kvtune-{image}-{v}.digest" for image in ("operator", "proxy")},
        **{f"{image}.sbom": f"kvtune-{image}-{v}.spdx.json" for image in ("operator", "proxy")},
    }
    return release / names[kind]


def digest(image: str) -> str:
    return artifact(f"{image}.digest").read_text().strip()
