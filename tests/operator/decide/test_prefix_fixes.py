"""The operator words defeats as the detector does: the same reasons and fixes (imported from core), with the
figures the metrics give where no report is at hand."""

from __future__ import annotations

from kvtune.core import prefix_defeats
from kvtune.operator.decide.prefix_fixes import REASONS, fix_text


def test_the_reasons_are_the_detectors() -> None:
    assert REASONS is prefix_defeats.REASONS


def test_fixes_from_metrics_carry_the_figures_they_have() -> None:
    assert fix_text("shorter_than_block", shared=10.4, block=16) == (
        "the shared prefix is 10 tokens, under one block of 16: lengthen it or use a smaller block"
    )
    assert fix_text("shorter_than_block") == (
        "the shared prefix is under one block: lengthen it or use a smaller block"
    )
    for reason in REASONS:  # the detector's wording, without an example's figures
        if reason != "shorter_than_block":
            assert fix_text(reason, shared=48.0, block=16) == prefix_defeats.fix_for(reason, 16)
    assert fix_text("new_reason").startswith("unknown reason 'new_reason'")


def test_a_report_from_the_detector_reads_in_the_doctor() -> None:
    """The detector's own report JSON, fed a timestamp-head workload, gives the doctor's varying_head line."""
    from kvtune.operator.io.prefix_report import defeat_entries, entry_line

    detector = prefix_defeats.PrefixDefeatDetector(16)
    shared = list(range(1000, 1200))
    for request in range(12):
        detector.observe("tiny", [1, 2, 3, *(9000 + request * 7 + i for i in range(8)), *shared])
    entries = defeat_entries(detector.report())
    assert entries and entries[0]["reason"] == "varying_head", detector.report()["reasons"]
    line = entry_line(entries[0])
    assert line.startswith("varying_head: tokens 3-10 vary (a timestamp or id?), then ")
    assert "move the varying span" in line
