"""`kvtune bench prefix-defeats` on a small evaluation set: the workloads are deterministic, labelled, and the
detector clears the issue's targets on them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from kvtune.bench import prefix_defeats
from kvtune.bench.defeat_workloads import generate
from kvtune.cli import main
from kvtune.core.prefix_defeats import REASONS


def test_workloads_are_deterministic_per_seed_and_cover_every_reason() -> None:
    first = list(generate(7, 1200, 16, engine_cache_blocks=800))
    assert first == list(generate(7, 1200, 16, engine_cache_blocks=800))
    assert first != list(generate(8, 1200, 16, engine_cache_blocks=800))
    labels = Counter(r.expected for r in first)
    assert all(labels[reason] >= 10 for reason in REASONS) and labels[None] > 300
    assert all(r.cached_tokens is None for r in generate(7, 50, 16))


@pytest.mark.parametrize("block_size", [16, 32])
def test_the_detector_clears_the_targets_on_an_unseen_workload(block_size: int) -> None:
    ev = prefix_defeats.evaluate(generate(11, 1500, block_size, engine_cache_blocks=1000), block_size)
    for reason in REASONS:
        assert ev.precision(reason) >= 0.95, (reason, ev.true_pos, ev.false_pos)
        assert ev.recall(reason) >= 0.95, (reason, ev.true_pos, ev.false_neg)
    assert ev.clean_requests > 100 and ev.false_flag_rate() <= 0.01


def test_the_command_prints_and_records_its_table(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    args = ["bench", "prefix-defeats", "--seeds", "1", "--requests", "300", "--block-sizes", "16", "--record"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| varying_head |" in printed and "False flags on clean shared-prefix traffic" in printed
    recorded = (tmp_path / "BENCHMARKS.md").read_text()
    assert (
        "<!-- kvtune:prefix-defeats:begin -->" in recorded
        and "Method:" in recorded
        and "| misaligned |" in recorded
    )
