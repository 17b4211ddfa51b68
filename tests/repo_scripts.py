"""The repository's scripts/*.py loaded as modules, so tests call the very functions `make` runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a fresh module named `name` (the scripts are not a package, so no import finds
    them); one loader for every test that reads a script's pins or runs its main."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
