"""`kvtune dashboards push` against a fake Grafana HTTP API on loopback (no Grafana installs here)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from kvtune.cli import main
from kvtune.dashboards.push import folder_uid, push
from kvtune.errors import KvtuneError
from tests.dashboards.fake_grafana import fake_grafana

COMMITTED = Path(__file__).resolve().parents[2] / "dashboards"
TOKEN = "glsa_test-token-0123456789"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "grafana.token"
    path.write_text(TOKEN + "\n")
    return path


def expected(uid: str) -> dict[str, object]:
    model: dict[str, object] = json.loads((COMMITTED / f"{uid}.json").read_text())
    model["id"] = None
    return model


def test_first_push_creates_the_folder_and_the_dashboards(
    token_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_grafana(TOKEN) as (url, grafana):
        code = main(["dashboards", "push", "--grafana-url", url, "--token-file", str(token_file)])
    assert code == 0
    assert grafana.problems == []
    assert grafana.folders == {"kvtune": "kvtune"}
    assert grafana.requests[:2] == [("GET", "/api/folders/kvtune"), ("POST", "/api/folders")]
    assert sorted(grafana.dashboards) == ["kvtune-kv-cache", "kvtune-latency", "kvtune-operator"]
    for uid, body in grafana.dashboards.items():
        assert body == {"dashboard": expected(uid), "folderUid": "kvtune", "overwrite": True}
        assert grafana.versions[uid] == 1
    out = capsys.readouterr().out
    assert "success: kvtune-kv-cache -> /d/kvtune-kv-cache/" in out


def test_second_push_updates_by_uid_in_the_existing_folder(token_file: Path) -> None:
    with fake_grafana(TOKEN) as (url, grafana):
        grafana.folders["team-llm"] = "Team LLM"  # made by someone else, found by its uid
        first = push(url, TOKEN, "Team LLM")
        second = push(url + "/", TOKEN, "Team LLM")
    assert grafana.problems == []
    assert ("POST", "/api/folders") not in grafana.requests
    assert [a["version"] for a in first] == [1, 1, 1]
    assert [a["version"] for a in second] == [2, 2, 2]
    assert [a["uid"] for a in second] == ["kvtune-kv-cache", "kvtune-operator", "kvtune-latency"]
    assert {body["folderUid"] for body in grafana.dashboards.values()} == {"team-llm"}
    assert len(grafana.dashboards) == 3


def test_a_wrong_token_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-token")
    with fake_grafana(TOKEN) as (url, grafana):
        code = main(["dashboards", "push", "--grafana-url", url, "--token-file", str(wrong)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"kvtune: error: Grafana at {url} refused the token (401)" in err
    assert grafana.dashboards == {} and grafana.folders == {}


def test_an_unreachable_grafana_is_one_clear_line() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(KvtuneError, match=rf"cannot reach Grafana at http://127.0.0.1:{port}"):
        push(f"http://127.0.0.1:{port}", TOKEN, "kvtune")


def test_a_missing_or_empty_token_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    for path, reason in ((tmp_path / "absent.token", "cannot read"), (empty, "is empty")):
        code = main(["dashboards", "push", "--grafana-url", "http://127.0.0.1:9", "--token-file", str(path)])
        assert code == 2
        assert reason in capsys.readouterr().err


def test_folder_uids_are_grafana_safe() -> None:
    assert folder_uid("kvtune") == "kvtune"
    assert folder_uid("Team LLM / prod") == "team-llm-prod"
    with pytest.raises(KvtuneError):
        folder_uid("///")
