"""`kvtune dashboards` and `kvtune report` are operator-side verbs: they load no torch and no web server."""

from __future__ import annotations

import pytest

from tests.imports_seen import heavy_imports, run_kvtune, user_output


@pytest.mark.parametrize(
    ("words", "shown"),
    [
        (("dashboards", "build", "--help"), "--out"),
        (("dashboards", "push", "--help"), "--token-file"),
        (("report", "--help"), "--since"),
    ],
)
def test_verb_help_loads_no_torch_nor_the_server(words: tuple[str, ...], shown: str) -> None:
    done = run_kvtune(*words)
    assert done.returncode == 0, user_output(done.stderr)
    assert shown in done.stdout
    assert heavy_imports(done.stderr) == set()


def test_dashboards_without_an_action_is_one_clear_line() -> None:
    done = run_kvtune("dashboards")
    assert done.returncode == 2
    assert user_output(done.stderr).strip() == "kvtune: error: the following arguments are required: ACTION"
