"""Hard-link installed distributions from one venv into another, so two venvs hold torch on disk once.

kvtune's venv and vLLM's both need torch 2.13 with its CUDA wheels (about 4.6 GB); a fresh machine's
`make test` ran out of disk holding them twice. Links share the files' inodes: pip in either venv removes
or replaces its own names only, so neither venv can change the other.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from importlib.metadata import Distribution, distributions
from pathlib import Path

# torch and the wheels it pins for its CUDA build: the heavy part of both venvs.
_TORCH_FAMILY = re.compile(r"^(torch|triton|nvidia-.+|cuda-.+)$")


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class LinkReport:
    """What `link_distributions` put into the target: distributions, files linked, files copied instead."""

    names: tuple[str, ...]
    linked: int
    copied: int

    def summary(self) -> str:
        return f"{len(self.names)} distributions from kvtune's venv ({self.linked} files linked, {self.copied} copied)"


def site_packages_distributions(site_packages: Path) -> dict[str, Distribution]:
    """The distributions installed in one site-packages folder, by normalized name."""
    return {normalized(dist.metadata["Name"]): dist for dist in distributions(path=[str(site_packages)])}


def torch_family(installed: dict[str, Distribution], torch_version: str) -> list[str]:
    """The names to share when the source holds torch at `torch_version`: torch and its CUDA wheels; none
    when its torch is another version (the target then installs its own)."""
    torch = installed.get("torch")
    if torch is None or torch.version != torch_version:
        return []
    return sorted(name for name in installed if _TORCH_FAMILY.match(name))


def _files_inside(dist: Distribution, site_packages: Path) -> list[Path]:
    """The distribution's recorded files under site-packages (console scripts in bin/ name the source's
    interpreter in their first line, so they stay behind)."""
    root = site_packages.resolve()
    inside: list[Path] = []
    for entry in dist.files or []:
        path = Path(os.path.normpath(root / entry))
        if path.is_relative_to(root) and path.is_file():
            inside.append(path.relative_to(root))
    return inside


def link_distributions(source_site: Path, target_site: Path, names: list[str]) -> LinkReport:
    """Link (or, across filesystems, copy) each named distribution's files from source to target."""
    installed = site_packages_distributions(source_site)
    linked = copied = 0
    for name in names:
        for relative in _files_inside(installed[name], source_site):
            source, target = source_site / relative, target_site / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            try:
                os.link(source, target)
                linked += 1
            except OSError:
                shutil.copy2(source, target)
                copied += 1
    return LinkReport(tuple(names), linked, copied)
