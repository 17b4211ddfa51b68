"""`kvtune doctor --metrics-file`: saved scrapes as the doctor's samples. On the recorded real vLLM in
docs/examples it prints the what-if table and the recommendation, with max_num_seqs read from vLLM's log;
without the log it says in one line which flag gives it; one scrape is read since boot and says what it
cannot tell; a bad file is one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtune.cli import main
from kvtune.errors import KvtuneError
from kvtune.operator.doctor.metrics_file import read_metrics_files, samples_of, split_scrapes
from tests.imports_seen import heavy_imports, run_kvtune, user_output
from tests.operator.helpers import FIXTURES
from tests.operator.recorded_metrics import RECORDED, RECORDED_LOG

T0, T1 = FIXTURES / "vllm_0_32_preempting_t0.prom", FIXTURES / "vllm_0_32_preempting_t1.prom"


def doctor(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, str]:
    code = main(["doctor", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_recorded_vllm_prints_the_what_if_table_and_the_recommendation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = doctor(capsys, "--metrics-file", str(RECORDED), "--vllm-log", str(RECORDED_LOG))
    assert code == 0
    assert "Engine: vllm 0.32.0 on cpu (vLLM's log); max_num_seqs 64 (--max-num-seqs in vLLM's log)" in out
    assert "[critical]" in out and "preemptions/s" in out
    assert "What-if (NoPreemption" in out and "max_num_seqs in multiples of 1: vLLM on cpu" in out
    assert "max_num_seqs  preemptions/min  goodput tok/s  p95 wait s  peak KV" in out
    assert "  recommendation: max_num_seqs " in out


def test_the_thirty_second_try_loads_no_torch() -> None:
    """The README's first command, in a fresh process as a user runs it: the table, and no torch."""
    done = run_kvtune("doctor", "--metrics-file", str(RECORDED), "--vllm-log", str(RECORDED_LOG))
    assert done.returncode == 0, user_output(done.stderr)
    assert "recommendation: max_num_seqs" in done.stdout
    assert heavy_imports(done.stderr) == set()


def test_recorded_vllm_without_its_log_names_the_flag_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = doctor(capsys, "--metrics-file", str(RECORDED))
    assert code == 0
    lines = out.splitlines()
    assert lines[1].startswith(
        "Engine: vllm; max_num_seqs unknown: vLLM's /metrics do not carry max_num_seqs"
    )
    assert "pass --max-num-seqs N" in lines[1]
    assert "What-if: no table" in out and "max_num_seqs  preemptions/min" not in out


def test_recorded_vllm_with_the_flag_rounds_as_the_operator_does_on_an_unknown_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = doctor(capsys, "--metrics-file", str(RECORDED), "--max-num-seqs", "64", "--json")
    assert code == 0
    report = json.loads(out)
    what_if = report["what_if"]
    assert report["engine_config"]["max_num_seqs_from"] == "--max-num-seqs"
    assert what_if["round_to"] == 8 and "CUDA assumed, as the operator does" in what_if["round_to_why"]
    assert what_if["recommended"] is not None and what_if["recommended"] % 8 == 0
    assert all(row["max_num_seqs"] % 8 == 0 or row["in_force"] for row in what_if["candidates"])


def test_one_scrape_is_read_since_boot_and_says_what_it_cannot_tell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = float(
        next(line for line in T1.read_text().splitlines() if line.startswith("process_start_time")).split()[1]
    )
    one = tmp_path / "one.prom"
    one.write_text(T1.read_text())
    os.utime(one, (started + 600, started + 600))  # saved ten minutes after the engine started
    code, out, _ = doctor(capsys, "--metrics-file", str(one), "--max-num-seqs", "32", "--json")
    report = json.loads(out)
    assert (
        code == 0 and report["basis"] == "since_boot" and report["since_boot_seconds"] == pytest.approx(600)
    )
    assert report["findings"]["preemptions"] == 29
    assert report["what_if"]["insufficient"].startswith(
        "one scrape: its counters count since the engine started"
    )


def test_two_files_are_a_window_timed_by_their_markers(tmp_path: Path) -> None:
    first, second = tmp_path / "t0.prom", tmp_path / "t1.prom"
    first.write_text("# scraped_at 100.5\n" + T0.read_text())
    second.write_text("# scraped_at 110.5\n" + T1.read_text())
    samples = read_metrics_files([str(first), str(second)])
    assert [s.timestamp for s in samples] == [100.5, 110.5]


def test_a_header_of_comments_is_not_a_scrape() -> None:
    text = '# Recorded from somewhere\n# scraped_at 5\nvllm:num_requests_running{engine="0"} 3\n'
    assert split_scrapes(text, 99.0) == [(5.0, '\nvllm:num_requests_running{engine="0"} 3\n')]
    assert split_scrapes('vllm:num_requests_running{engine="0"} 3\n', 99.0)[0][0] == 99.0


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            "# scraped_at soon\nvllm:num_requests_running 1\n",
            "'# scraped_at soon' is not `# scraped_at UNIX_SECONDS`",
        ),
        ("vllm:num_requests_running{ 1\n", "not Prometheus text"),
        ("some_other_metric 1\n", "none of the vLLM, SGLang or kvtune series"),
        ("# only a comment\n", "no metrics in it"),
        (
            "# scraped_at 20\nvllm:num_requests_running 1\n# scraped_at 10\nvllm:num_requests_running 1\n",
            "not in time order",
        ),
    ],
)
def test_a_bad_file_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, says: str
) -> None:
    bad = tmp_path / "bad.prom"
    bad.write_text(body)
    code, out, err = doctor(capsys, "--metrics-file", str(bad))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err


def test_a_missing_file_and_a_bad_log_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = doctor(capsys, "--metrics-file", str(tmp_path / "absent.prom"))
    assert (
        code == 2
        and err.strip()
        == f"kvtune: error: --metrics-file {tmp_path / 'absent.prom'}: No such file or directory"
    )
    not_vllm = tmp_path / "app.log"
    not_vllm.write_text("INFO: started\n")
    code, _, err = doctor(capsys, "--metrics-file", str(T1), "--vllm-log", str(not_vllm))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--vllm-log:" in err


def test_samples_of_keeps_the_source_name() -> None:
    with pytest.raises(KvtuneError, match=r"^x\.prom: no metrics in it"):
        samples_of("", 0.0, "x.prom")
