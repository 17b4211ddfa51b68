"""Build syft, the SBOM generator a release runs on its images, from the Go module proxy into a cache outside
the clone (`make syft-tools`); print its path.

No registry these machines reach ships a syft binary; github.com/anchore/syft is a Go module, built with
`go install …@VERSION` (GOFLAGS=-mod=mod: the module's go.mod is not what its build list needs as is). The
version is stamped by ldflags as syft's release build does, else its SBOMs name the tool `syft-[not
provided]`. The cache is $KVTUNE_SYFT_DIR, else ~/.cache/kvtune/syft/<version>; running it again is a no-op
once the binary there reports the pinned version. Standard library only.

usage: python scripts/build_syft.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

try:
    import pinned_tools  # run as a script: scripts/ is on sys.path
except ImportError:  # loaded by path, with the repository root on sys.path
    from scripts import pinned_tools

VERSION = "v1.57.2"
MODULE = "github.com/anchore/syft"
LDFLAGS = f"-s -w -X main.version={VERSION.removeprefix('v')}"
BuildError = pinned_tools.BuildError


def built_version(syft: Path) -> str | None:
    """The version `syft version -o json` reports (with a leading v); None when missing or broken."""
    try:
        done = subprocess.run(
            [str(syft), "version", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SYFT_CHECK_FOR_APP_UPDATE": "false"},
        )
        reported = json.loads(done.stdout)["version"] if done.returncode == 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return f"v{reported}" if reported else None


# GOFLAGS=-mod=mod: the module's go.mod is not what its build list needs as is
SYFT = pinned_tools.GoTool(
    "build_syft.py",
    "syft",
    MODULE,
    VERSION,
    LDFLAGS,
    "KVTUNE_SYFT_DIR",
    built_version,
    env={"GOFLAGS": "-mod=mod"},
)
syft_dir = SYFT.cache
build = SYFT.build


def main(argv: list[str]) -> int:
    return SYFT.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
