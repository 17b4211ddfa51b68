"""What the scripts that put a pinned tool in place share (build_helm4.py, build_syft.py, install_helm.py): the
one-line report of a run, and a Go module's `go install` into a cache outside the clone. Standard library only.

They import it as `pinned_tools` when run as scripts (scripts/ is on sys.path) and as `scripts.pinned_tools`
when loaded by path from the repository root (the tests, release.py's `script()`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class BuildError(Exception):
    """Why a Go tool could not be built, printed as one line (and go's last lines)."""


def report(
    attempt: str, step: Callable[[], T], errors: tuple[type[Exception], ...], done: Callable[[T], str]
) -> int:
    """Run a script's one step: what it did on stdout and 0, or `error: cannot ATTEMPT: why` on stderr and 1."""
    try:
        outcome = step()
    except errors as err:
        print(f"error: cannot {attempt}: {err}", file=sys.stderr)
        return 1
    print(done(outcome))
    return 0


@dataclass(frozen=True)
class GoTool:
    """A binary built by `go install MODULE/cmd/NAME@VERSION` into ~/.cache/kvtune/NAME/VERSION ($CACHE_VARIABLE
    overrides); building again is a no-op once the binary there reports the pinned version."""

    script: str  # the script's file name, for its usage line
    name: str
    module: str
    version: str
    ldflags: str
    cache_variable: str
    built_version: Callable[[Path], str | None]  # what the binary says it is; None when missing or broken
    label: str = ""  # how the build line names it (default "NAME VERSION")
    duration: str = ""  # appended to the build line, e.g. ", ~3 min on 2 cores"
    env: Mapping[str, str] = field(default_factory=dict)  # for `go install`, beside CGO_ENABLED=0 and GOBIN

    def cache(self) -> Path:
        override = os.environ.get(self.cache_variable)
        if override:
            return Path(override)
        return Path.home() / ".cache" / "kvtune" / self.name / self.version

    def build(self, dest: Path) -> float | None:
        """Build the tool into `dest` unless the pinned one is there; the seconds it took, or None if it was."""
        binary = dest / self.name
        if self.built_version(binary) == self.version:
            return None
        go = shutil.which("go")
        if go is None:
            raise BuildError(f"`go` (1.26 or newer) is not on PATH: it builds {self.module}@{self.version}")
        dest.mkdir(parents=True, exist_ok=True)
        label = self.label or f"{self.name} {self.version}"
        print(
            f"building {label} from the Go module proxy into {dest}: once per machine{self.duration}",
            flush=True,
        )
        began = time.monotonic()
        target = f"{self.module}/cmd/{self.name}@{self.version}"
        # Built into a folder beside the cache and renamed into it, so an interrupted build leaves no half binary.
        with tempfile.TemporaryDirectory(prefix=".partial-", dir=dest) as partial:
            done = subprocess.run(
                [go, "install", "-trimpath", "-ldflags", self.ldflags, target],
                cwd=partial,
                env={**os.environ, "CGO_ENABLED": "0", "GOBIN": partial, **self.env},
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-20:])
                raise BuildError(f"`go install {target}` failed:\n{tail}")
            os.replace(Path(partial) / self.name, binary)
        reported = self.built_version(binary)
        if reported != self.version:
            raise BuildError(
                f"{binary} was built but `{self.name} version` says {reported!r}, not {self.version}"
            )
        return time.monotonic() - began

    def main(self, argv: list[str]) -> int:
        """The script's command line: no arguments; builds into the cache and says where the binary is."""
        if argv:
            print(f"usage: python scripts/{self.script}", file=sys.stderr)
            return 2
        dest = self.cache()
        what = f"{self.name} {self.version}"

        def done(took: float | None) -> str:
            if took is None:
                return f"{what} already built: {dest / self.name}"
            return f"built {what} in {took:.0f} s: {dest / self.name}"

        return report(f"build {what} into {dest}", lambda: self.build(dest), (BuildError, OSError), done)
