"""`kvtune rules build`: writes both renderings, says so, refuses a bad --out in one line, and loads
neither torch nor the server (it runs in a CI step or an operator image)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtune.cli import main
from kvtune.observability import command
from tests.imports_seen import heavy_imports, run_kvtune, user_output


def test_build_writes_both_files_and_the_charts_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, chart = tmp_path / "out", tmp_path / "chart"
    assert main(["rules", "build", "--out", str(out), "--chart-out", str(chart)]) == 0
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(command.rendered_files())
    assert [p.name for p in chart.iterdir()] == [command.RULES_FILE]
    assert (chart / command.RULES_FILE).read_text() == (out / command.RULES_FILE).read_text()
    assert capsys.readouterr().out.count("\n") == 3


def test_build_into_a_file_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["rules", "build", "--out", str(blocker), "--chart-out", str(tmp_path / "chart")]) == 2
    assert capsys.readouterr().err.strip() == f"kvtune: error: --out {blocker} is not a directory"
    assert main(["rules", "build", "--out", str(tmp_path / "out"), "--chart-out", str(blocker)]) == 2
    assert capsys.readouterr().err.strip() == f"kvtune: error: --chart-out {blocker} is not a directory"


def test_build_loads_no_torch_nor_the_server(tmp_path: Path) -> None:
    done = run_kvtune("rules", "build", "--out", str(tmp_path), "--chart-out", str(tmp_path / "chart"))
    assert done.returncode == 0, user_output(done.stderr)
    assert (tmp_path / command.RULES_FILE).read_text() == command.rendered_files()[command.RULES_FILE]
    assert heavy_imports(done.stderr) == set()


def test_rules_without_an_action_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["rules"])
    assert exit_.value.code == 2
    assert "kvtune: error:" in capsys.readouterr().err
