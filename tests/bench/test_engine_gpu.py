"""`python -m kvtune.bench.engine_gpu` (scripts/gpu_check.sh step 3), run here on CPU: the same code that
serves the tiny and the small model on CUDA boots a real `kvtune serve`, sends a few short requests through
kvtune's load generator and writes the table and the server logs; the budget and the missing-wheel case
end it with a row that says why, never a hang or a traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtune.bench import engine_gpu

SHORT = (
    "--device", "cpu", "--threads", "1", "--num-requests", "4", "--prompt-tokens", "8", "16",
    "--output-tokens", "4", "8", "--kv-cache-tokens", "1024", "--max-num-seqs", "4", "--max-model-len", "256",
)  # fmt: skip


def _table(out: Path) -> str:
    return (out / engine_gpu.TABLE_FILE).read_text()


def test_cpu_smoke_serves_the_tiny_model_and_records_tokens_per_second(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [*SHORT, "--models", "tiny", "--out", str(out), "--model-root", str(tmp_path / "models")]
    assert engine_gpu.main(argv) == 0
    table = _table(out)
    assert "## kvtune serve end to end on cpu" in table
    row = next(line for line in table.splitlines() if line.startswith("| tiny |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == "2,363,136" and cells[2] == "4 of 4" and cells[-1] == "ok"
    assert 16 <= int(cells[3].replace(",", "")) <= 32  # 4 requests of 4-8 tokens each, ignore_eos
    assert float(cells[5].replace(",", "")) > 0  # tokens/s
    logs = (out / engine_gpu.LOGS_FILE).read_text()
    assert logs.startswith("===== kvtune-serve-tiny.log =====")
    assert "--device cpu" in logs and "--dtype bfloat16" in logs
    assert sorted(path.name for path in out.iterdir()) == sorted(
        [engine_gpu.TABLE_FILE, engine_gpu.LOGS_FILE]
    )
    assert (tmp_path / "models" / "tiny" / "config.json").is_file()


def test_a_spent_budget_starts_nothing_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [*SHORT, "--seconds", "0", "--out", str(out), "--model-root", str(tmp_path / "models")]
    assert engine_gpu.main(argv) == 1
    table = _table(out)
    assert "| tiny | 2,363,136 | – | – | – | – |" in table
    assert "| small | 135,822,336 | – | – | – | – |" in table
    assert table.count("not run: 0 s of the budget left") == 2
    assert not (tmp_path / "models").exists()  # not even the checkpoints are written


def test_missing_server_packages_are_named_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_gpu, "SERVER_MODULES", ("json", "kvtune_no_such_module"))
    assert engine_gpu.main([*SHORT, "--out", str(tmp_path)]) == 2
    assert "not run" in _table(tmp_path) and "kvtune_no_such_module" in _table(tmp_path)


def test_serve_command_runs_on_the_asked_device_with_the_issues_pool(tmp_path: Path) -> None:
    args = engine_gpu.parse_args(["--device", "cuda"])
    assert args.models == ["tiny", "small"] and args.dtype == "bfloat16"
    assert (args.num_requests, tuple(args.prompt_tokens), tuple(args.output_tokens)) == (
        96,
        (300, 700),
        (500, 1500),
    )
    argv = engine_gpu.serve_command(args, tmp_path, 8123)

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert argv[1:4] == ["-m", "kvtune.cli", "serve"]
    assert (flag("--device"), flag("--dtype"), flag("--kv-cache-tokens")) == ("cuda", "bfloat16", "32768")
    assert (flag("--block-size"), flag("--max-num-seqs")) == ("32", "64")
    assert "--threads" not in argv


@pytest.mark.parametrize(
    "argv",
    [
        ("--device", "cuda", "--prompt-tokens", "700", "300"),
        ("--device", "cuda", "--output-tokens", "500", "4000"),
        ("--device", "cuda", "--num-requests", "0"),
        ("--device", "cuda", "--models", "huge"),
        (),  # --device is required: the GPU check must say where it runs
    ],
)
def test_bad_arguments_exit_with_usage(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as exited:
        engine_gpu.parse_args(argv)
    assert exited.value.code == 2


def test_sigterm_stops_the_server_and_still_writes_the_table(tmp_path: Path) -> None:
    """gpu_check.sh's outer `timeout` sends SIGTERM: the server (in a process group of its own) must not
    outlive the driver and hold the device through the next step."""
    out = tmp_path / "out"
    argv = [*SHORT, "--models", "tiny", "--out", str(out), "--output-tokens", "3000", "3500"]
    argv[argv.index("--max-model-len") + 1] = "4096"
    argv[argv.index("--kv-cache-tokens") + 1] = "8192"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PYTHONUNBUFFERED": "1"}
    driver = subprocess.Popen(
        [sys.executable, "-m", "kvtune.bench.engine_gpu", *argv], stdout=subprocess.PIPE, text=True, env=env
    )
    assert driver.stdout is not None
    assert any("ready after" in line for line in driver.stdout)  # stops reading at the first match
    time.sleep(1.0)  # into the warm-up or the batch
    driver.send_signal(signal.SIGTERM)
    driver.stdout.read()
    assert driver.wait(60) == 128 + signal.SIGTERM
    assert "| tiny | 2,363,136 |" in _table(out) and "stopped by SIGTERM" in _table(out)
    started = re.search(r"Started server process \[(\d+)\]", (out / engine_gpu.LOGS_FILE).read_text())
    assert started is not None
    with pytest.raises(ProcessLookupError):
        os.kill(int(started.group(1)), 0)


def test_a_server_that_cannot_boot_is_a_row_with_its_own_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [*SHORT, "--models", "tiny", "--out", str(out), "--max-model-len", "8192"]  # the model has 4096
    assert engine_gpu.main(argv) == 1
    assert "boot failed: kvtune: error: --max-model-len 8192 exceeds the model's 4096" in _table(out)


def test_gpu_check_script_parses_and_runs_the_engine_before_the_full_grid() -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    engine = text.index("-m kvtune.bench.engine_gpu --device cuda --dtype bfloat16")
    assert text.index("-m kvtune.cli bench kernels --skip-cpu") < engine < text.index("--runslow -x")
    assert '--seconds "$engine_s"' in text[engine:]  # the step runs on the script's budget, not its own
