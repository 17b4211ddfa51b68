"""No module under tests/ imports a test module: what two test files share lives in a helper module (or a
conftest fixture), whose name does not start with `test_`, and helpers and conftests import only helpers. A
test module imported elsewhere runs its module body twice under two names, and its tests are collected again
wherever a `test_*` name is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def imports_of_test_modules(source: str) -> list[str]:
    """Each import in `source` (anywhere in it, relative or absolute) that names a module whose last dotted
    part starts with `test_`, spelled as the import reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {alias.name}" for alias in node.names if is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.module is not None and is_test_module(node.module):
                found.append(f"from {module} import {', '.join(alias.name for alias in node.names)}")
            else:  # `from package import test_x` imports the module test_x
                found += [
                    f"from {module} import {alias.name}" for alias in node.names if is_test_module(alias.name)
                ]
    return found


def is_test_module(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def test_no_module_under_tests_imports_a_test_module() -> None:
    """Every .py under tests/: test modules, helpers, conftests and __init__ files alike (this module's
    examples below are strings, not imports, so they are not found)."""
    modules = sorted(TESTS.rglob("*.py"))
    assert TESTS / "conftest.py" in modules and Path(__file__).resolve() in modules
    offenders = [
        f"{path.relative_to(TESTS.parent)}: {line}"
        for path in modules
        for line in imports_of_test_modules(path.read_text())
    ]
    listed = "\n".join(offenders)
    assert not offenders, f"modules importing test modules (move what they share to a helper):\n{listed}"


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import tests.server.test_bad_inputs", ["import tests.server.test_bad_inputs"]),
        ("import tests.server.test_bad_inputs as bad", ["import tests.server.test_bad_inputs"]),
        ("from tests.server.test_bad_inputs import x, y", ["from tests.server.test_bad_inputs import x, y"]),
        ("from tests.server import test_bad_inputs", ["from tests.server import test_bad_inputs"]),
        ("from tests.server import live_server, test_x", ["from tests.server import test_x"]),
        ("from .test_bad_inputs import x", ["from .test_bad_inputs import x"]),
        ("from . import test_bad_inputs", ["from . import test_bad_inputs"]),
        ("from ..server.test_bad_inputs import x", ["from ..server.test_bad_inputs import x"]),
        ("from .. import test_cli", ["from .. import test_cli"]),
        (
            "def f():\n    from tests.chart.test_render_matrix import closed\n",
            ["from tests.chart.test_render_matrix import closed"],
        ),
        ("import test_module", ["import test_module"]),
    ],
    ids=[
        "import",
        "import-as",
        "from-module",
        "from-package",
        "from-package-among-helpers",
        "relative-module",
        "relative-package",
        "relative-parent-module",
        "relative-parent-package",
        "inside-a-function",
        "top-level",
    ],
)
def test_the_check_finds_each_form(source: str, found: list[str]) -> None:
    assert imports_of_test_modules(source) == found


@pytest.mark.parametrize(
    "source",
    [
        "from tests.server.live_server import LiveServer",
        "from tests.proxy import conftest as proxy_conftest",
        "import tests.chart.helm",
        "from . import helpers",
        "from .crd_schemas import closed",
        "import pytest_asyncio",
        "from tests.front.openai_errors import assert_openai_error",
        "from testing import test",  # a module named test (no underscore) is not a test module
    ],
)
def test_the_check_leaves_helpers_alone(source: str) -> None:
    assert imports_of_test_modules(source) == []
