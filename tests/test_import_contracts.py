"""Every import-linter contract in pyproject.toml can fail: each is broken on purpose in a copy of the
package, and lint-imports must name it broken (a contract that lists a module by a stale name, or whose
layers are spelled so that nothing can cross them, would otherwise pass for ever).

The breaking imports are derived from each contract itself, so a new contract is covered without a new
test: a `forbidden` contract gets, in each of its source modules, an import of each forbidden module; a
`layers` contract an import of its top layer from its bottom one (and of one independent sibling from
another); an `independence` contract an import of its second module from its first.

The top level is one exhaustive `layers` contract: every package under kvtune/ has a floor in it, and a new
one fails lint until it is given one (so do new rooms of the engine and the operator).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS: list[dict[str, Any]] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"][
    "importlinter"
]["contracts"]
EXHAUSTIVE = [c for c in CONTRACTS if c["type"] == "layers" and c.get("exhaustive")]
UNPLACED = "unplaced_for_the_test"


def _module_path(root: Path, module: str) -> Path:
    """The file that holds `module` in the copy: a package's __init__.py, or the module's own file."""
    base = root.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _siblings(layer: str) -> list[str]:
    """The modules of one layer entry: `a | b` (independent) or `a : b` (not), or a single name."""
    return [part.strip() for part in re.split(r"[|:]", layer)]


def _children(package: Path) -> set[str]:
    """The modules and packages directly inside `package`, as import-linter sees them."""
    return {
        child.stem if child.is_file() else child.name
        for child in package.iterdir()
        if (child.suffix == ".py" and child.name != "__init__.py") or (child / "__init__.py").is_file()
    }


def breaking_imports(contract: dict[str, Any]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that each break `contract`."""
    kind = contract["type"]
    if kind == "forbidden":
        return [
            (source, banned)
            for source in contract["source_modules"]
            for banned in contract["forbidden_modules"]
        ]
    if kind == "independence":
        first, second = contract["modules"][:2]
        return [(first, second)]
    if kind == "layers":
        pairs = []
        for container in contract.get("containers", [""]):
            prefix = f"{container}." if container else ""
            top, bottom = _siblings(contract["layers"][0]), _siblings(contract["layers"][-1])
            pairs.append((prefix + bottom[0], prefix + top[0]))
            for layer in contract["layers"]:
                if "|" in layer:  # independent siblings
                    first, second = _siblings(layer)[:2]
                    pairs.append((prefix + second, prefix + first))
        return pairs
    raise AssertionError(f"no breaking import known for a {kind} contract: teach this test one")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def copy_package(root: Path) -> None:
    shutil.copytree(
        REPO / "kvtune", root / "kvtune", ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc")
    )
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")


def verdicts(output: str) -> dict[str, str]:
    """Contract name -> KEPT or BROKEN, from lint-imports' report (which wraps long names)."""
    text = " ".join(output.split())
    return {
        c["name"]: ("BROKEN" if f"{c['name']} BROKEN" in text else "KEPT")
        for c in CONTRACTS
        if c["name"] in text
    }


@pytest.fixture(scope="module")
def broken_report(tmp_path_factory: pytest.TempPathFactory) -> str:
    """lint-imports' report on a copy of the package that breaks every contract at once."""
    root = tmp_path_factory.mktemp("contracts")
    copy_package(root)
    for contract in CONTRACTS:
        for importer, imported in breaking_imports(contract):
            with _module_path(root, importer).open("a") as module:
                module.write(f"\nimport {imported}  # breaks: {contract['name']}\n")
    done = lint(root)
    assert done.returncode != 0, done.stdout
    return done.stdout


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    copy_package(tmp_path)
    done = lint(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(verdicts(done.stdout).values()) == {"KEPT"}
    assert len(verdicts(done.stdout)) == len(CONTRACTS)


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c["name"][:60] for c in CONTRACTS])
def test_a_contract_broken_on_purpose_is_reported(contract: dict[str, Any], broken_report: str) -> None:
    assert verdicts(broken_report).get(contract["name"]) == "BROKEN", broken_report
    text = " ".join(broken_report.split())
    for importer, imported in breaking_imports(contract):
        assert f"{importer} -> {imported}" in text, (importer, imported)


def test_the_top_level_is_one_exhaustive_layers_contract_that_places_every_package() -> None:
    top = [c for c in CONTRACTS if c["type"] == "layers" and c.get("containers") == ["kvtune"]]
    assert len(top) == 1, "one layers contract over kvtune"
    assert top[0].get("exhaustive") is True
    placed = [name for layer in top[0]["layers"] for name in _siblings(layer)]
    assert sorted(placed) == sorted(_children(REPO / "kvtune"))
    rooms = {container for c in EXHAUSTIVE for container in c["containers"]}
    assert {"kvtune", "kvtune.engine", "kvtune.operator"} <= rooms


def test_a_new_module_fails_lint_until_it_is_placed(tmp_path: Path) -> None:
    """A new package at the top level, and a new room in the engine and in the operator: each exhaustive
    contract names it unplaced; given a floor (the bottom one, beside the modules there), lint passes."""
    copy_package(tmp_path)
    for contract in EXHAUSTIVE:
        for container in contract["containers"]:
            _module_path(tmp_path, container).with_name(f"{UNPLACED}.py").write_text("")
    done = lint(tmp_path)
    assert done.returncode != 0, done.stdout
    text = " ".join(done.stdout.split())
    for contract in EXHAUSTIVE:
        assert verdicts(done.stdout).get(contract["name"]) == "BROKEN", done.stdout
        for container in contract["containers"]:
            assert f"- {container}.{UNPLACED}" in text, (container, done.stdout)

    config = tmp_path / "pyproject.toml"
    text = config.read_text()
    for contract in EXHAUSTIVE:
        bottom = f'"{contract["layers"][-1]}"'
        assert text.count(bottom) == 1, bottom
        text = text.replace(bottom, f'"{contract["layers"][-1]} | {UNPLACED}"')
    config.write_text(text)
    done = lint(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
