"""The servers' memory figure: the peak summed PSS of a process group, sampled while a batch runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvtune.harness.process_memory import PeakMemory, _group_of, group_pss_bytes

HOLD_MIB = 160


def test_the_group_id_is_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    assert _group_of("4242 (my (odd) name) S 1 4240 4240 0 -1") == 4240


def test_a_group_nobody_is_in_reads_none(tmp_path: Path) -> None:
    assert group_pss_bytes(os.getpgrp(), proc=tmp_path) is None


def test_the_peak_sees_what_a_child_group_holds() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", f"import time; held = bytearray({HOLD_MIB} << 20); held[::4096] = b'x' * len(held[::4096]); time.sleep(4)"],
        start_new_session=True,
    )  # fmt: skip
    try:
        with PeakMemory(child.pid, every_s=0.1) as peak:
            child.wait(30)
    finally:
        child.kill()
    assert peak.bytes is not None
    assert HOLD_MIB << 20 <= peak.bytes < (HOLD_MIB + 200) << 20  # the buffer plus one interpreter
