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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERSION = "v1.57.2"
MODULE = "github.com/anchore/syft"
LDFLAGS = f"-s -w -X main.version={VERSION.removeprefix('v')}"


class BuildError(Exception):
    """Why syft could not be built, printed as one line (and go's last lines)."""


def syft_dir() -> Path:
    override = os.environ.get("KVTUNE_SYFT_DIR")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "kvtune" / "syft" / VERSION


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


def build(dest: Path) -> float | None:
    """Build syft into `dest` unless the pinned one is there; the seconds it took, or None if it was."""
    syft = dest / "syft"
    if built_version(syft) == VERSION:
        return None
    go = shutil.which("go")
    if go is None:
        raise BuildError(f"`go` (1.26 or newer) is not on PATH: it builds {MODULE}@{VERSION}")
    dest.mkdir(parents=True, exist_ok=True)
    print(f"building syft {VERSION} from the Go module proxy into {dest}: once per machine", flush=True)
    began = time.monotonic()
    # Built into a folder beside the cache and renamed into it, so an interrupted build leaves no half binary.
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=dest) as partial:
        done = subprocess.run(
            [go, "install", "-trimpath", "-ldflags", LDFLAGS, f"{MODULE}/cmd/syft@{VERSION}"],
            cwd=partial,
            env={**os.environ, "CGO_ENABLED": "0", "GOBIN": partial, "GOFLAGS": "-mod=mod"},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-20:])
            raise BuildError(f"`go install {MODULE}/cmd/syft@{VERSION}` failed:\n{tail}")
        os.replace(Path(partial) / "syft", syft)
    reported = built_version(syft)
    if reported != VERSION:
        raise BuildError(f"{syft} was built but `syft version` says {reported!r}, not {VERSION}")
    return time.monotonic() - began


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python scripts/build_syft.py", file=sys.stderr)
        return 2
    dest = syft_dir()
    try:
        took = build(dest)
    except (BuildError, OSError) as err:
        print(f"error: cannot build syft {VERSION} into {dest}: {err}", file=sys.stderr)
        return 1
    if took is None:
        print(f"syft {VERSION} already built: {dest / 'syft'}")
    else:
        print(f"built syft {VERSION} in {took:.0f} s: {dest / 'syft'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
