"""Bad input gets one clear line on stderr and a non-zero exit; good input draws the memory map."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.imports_seen import heavy_imports
from tests.sim.conftest import kvtune


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sim", "--block-size", "0"], "block size must be positive"),
        (["sim", "--block-size", "-16"], "block size must be positive"),
        (["sim", "--policy", "buddy"], "unknown policy"),
        (["sim", "--scenario", "ShareGPT"], "unknown scenario"),
        (["sim", "--pool-tokens", "2000"], "smaller than one request"),
        (["sim", "--policy", "contiguous", "--pool-tokens", "7000"], "smaller than one request"),
        (["sim", "--prompt-dist", "uniform:9:3"], "LO <= HI"),
        (["sim", "--prompt-dist", "zipf:1.2"], "unknown distribution"),
        (["sim", "--prompt-dist", "normal:abc:3"], "must be numbers"),
        (["sim", "--output-dist", "fixed"], "takes 1 number"),
        (["sim", "--spread", "150"], "percentage"),
        (["sim", "--max-tokens", "-5"], "must be positive"),
        (["sim", "--pool-gib", "-1"], "must be positive"),
        (["sim", "--steps", "two"], "expected an integer"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], message: str) -> None:
    done = kvtune(*args)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0]


def test_plot_draws_a_png(tmp_path: Path) -> None:
    out = tmp_path / "map.png"
    done = kvtune("sim", "--steps", "300", "--plot", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


def test_pool_from_model_geometry() -> None:
    # 4 layers x 2 KV heads x 32 dims x 2 bytes x 2 = 1 KiB per token: 1 GiB holds 1,048,576 tokens.
    done = kvtune(
        "sim", "--steps", "300", "--pool-gib", "1", "--layers", "4", "--kv-heads", "2", "--head-dim", "32"
    )
    assert done.returncode == 0, done.stderr
    assert "resident sequences" in done.stdout


def test_the_seed_table_loads_no_torch_nor_the_server(
    seed_table_run: subprocess.CompletedProcess[str],
) -> None:
    assert heavy_imports(seed_table_run.stderr) == set()
