"""A verb's module is imported only when that verb runs: the operator's verbs load no torch, no fastapi and
no uvicorn (the seed table's run is checked in tests/sim, where it is computed once per session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.imports_seen import heavy_imports, run_kvtune, user_output
from tests.operator.helpers import fixture_text, serve_bodies


@pytest.fixture()
def metrics_stub() -> Iterator[str]:
    """A loopback server that answers every GET with a recorded kvtune /metrics page."""
    yield from serve_bodies([fixture_text("kvtune_preempting_t1.prom")])


def test_operator_help_loads_no_torch_nor_the_server() -> None:
    done = run_kvtune("operator", "--help")
    assert done.returncode == 0, user_output(done.stderr)
    assert "--local" in done.stdout
    assert heavy_imports(done.stderr) == set()


def test_doctor_loads_no_torch_nor_the_server(metrics_stub: str) -> None:
    done = run_kvtune("doctor", "--metrics-url", metrics_stub)
    assert done.returncode == 0, user_output(done.stderr)
    assert "preempt" in done.stdout.lower()
    assert heavy_imports(done.stderr) == set()


def test_serve_does_load_torch() -> None:
    """The check can see an import: `serve --help` needs the engine's flags, which live beside torch."""
    done = run_kvtune("serve", "--help")
    assert done.returncode == 0, user_output(done.stderr)
    assert "torch" in heavy_imports(done.stderr)
