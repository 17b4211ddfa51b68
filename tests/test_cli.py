"""The command line's contract when a verb's packages are missing: that verb says so in one line and exits
2; every other verb keeps working (a GPU image without the server's packages runs `kvtune bench kernels`)."""

from __future__ import annotations

import sys

import pytest

from kvtune.cli import main


def _without(monkeypatch: pytest.MonkeyPatch, package: str, *modules: str) -> None:
    """Makes `import package` fail, and forgets `modules` so that they import it again."""
    monkeypatch.setitem(sys.modules, package, None)
    for module in modules:
        monkeypatch.delitem(sys.modules, module, raising=False)


def test_a_verb_whose_package_is_missing_says_which_and_exits_2(monkeypatch, capsys):
    _without(monkeypatch, "uvicorn", "kvtune.engine.command")
    assert main(["serve", "--tiny", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "kvtune: error: `kvtune serve` needs the Python package 'uvicorn', which is not installed here"
    )


def test_other_verbs_still_parse_and_run(monkeypatch, capsys):
    _without(monkeypatch, "uvicorn", "kvtune.engine.command")
    with pytest.raises(SystemExit) as exited:
        main(["bench", "kernels", "--bogus"])  # parsed by its own parser, which rejects the flag
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == "kvtune: error: unrecognized arguments: --bogus"
    with pytest.raises(SystemExit) as exited:
        main(["doctor", "--help"])
    assert exited.value.code == 0
    assert "--metrics-url" in capsys.readouterr().out


def test_unknown_flags_of_an_installed_verb_are_still_rejected(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["doctor", "--metrics-url", "http://127.0.0.1:9/metrics", "--no-such-flag"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == "kvtune: error: unrecognized arguments: --no-such-flag"
