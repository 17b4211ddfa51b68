"""The bench's one workload catalog: its named and seeded random workloads, a workload given by flags named for
what it is, and a workload stored in a result read back."""

from __future__ import annotations

import json

import pytest

from kvtune.bench.workloads import NAMED, catalog, flags_name, from_flags, random_workloads
from kvtune.harness.load import LoadShape


def test_random_workloads_spread_over_pool_ratio_and_shape_and_are_seeded() -> None:
    found = random_workloads(28)
    assert found == random_workloads(28) and found != random_workloads(29)
    ratios = sorted(w.ratio for w in found)
    shares = sorted(w.prompt_share for w in found)
    assert (
        3 <= ratios[0] < 3 * (20 / 3) ** (1 / 3) <= ratios[1] < 3 * (20 / 3) ** (2 / 3) <= ratios[2] <= 20.5
    )
    assert shares[0] < 0.4 and 0.4 <= shares[1] < 0.6 and shares[2] >= 0.6  # output-heavy to prompt-heavy
    for w in found:
        assert w.load.clients > w.ratio  # over-subscribed: max_num_seqs binds
        assert w.kv_cache_tokens >= w.load.prompt_len[1] + w.load.output_len[1]  # every request fits alone
        assert min(w.sweep) < w.ratio < max(w.sweep)
        assert w.load.prompt_len[1] + w.load.output_len[1] <= 4096  # the tiny model's context
        assert w.why == f"seeded random workload (seed 28): {w.describe()}"


def test_the_catalog_holds_the_named_workloads_issue_28_and_the_random_ones() -> None:
    issue = NAMED["issue-28"]
    assert (issue.kv_cache_tokens, issue.load.clients, issue.load.prompt_len, issue.load.output_len) == (
        10240,
        40,
        (600, 1400),
        (40, 400),
    )
    assert issue.ratio == pytest.approx(8.4, abs=0.05)
    assert list(catalog()) == ["default", "wide-prompts", "long-outputs", "issue-28", *(
        f"random-28-{i}" for i in (1, 2, 3))]  # fmt: skip
    # the random ones as BENCHMARKS.md recorded them (issue 28's sections)
    first = catalog()["random-28-1"]
    assert (first.kv_cache_tokens, first.load.clients, first.load.prompt_len, first.load.output_len) == (
        1840,
        7,
        (120, 353),
        (101, 297),
    )
    assert first.start == 14


def test_flags_that_change_the_pool_or_load_make_a_workload_named_for_what_it_is() -> None:
    default = NAMED["default"]
    assert from_flags(default) == default
    assert (
        from_flags(default, kv_cache_tokens=4096, prompt_len="200:400") == default
    )  # the preset's own values
    moved = from_flags(default, start=32, sweep="4,8")
    assert (moved.name, moved.start, moved.sweep) == ("default", 32, (4, 8))
    new = from_flags(default, kv_cache_tokens=6144, clients=24, prompt_len="100:2400", output_len="20:1200")
    assert new.name == "pool-6144-clients-24-prompts-100-2400-outputs-20-1200"
    assert new.name == flags_name(6144, LoadShape(24, (100, 2400), (20, 1200)))
    assert new.why == f"given by flags: {new.describe()}"
    assert (new.start, new.sweep) == (default.start, default.sweep)


def test_a_workload_stored_in_a_result_reads_back_the_same() -> None:
    for w in catalog().values():
        stored = json.loads(json.dumps(w.record()))
        back = type(w).from_record(stored)
        assert (back.name, back.kv_cache_tokens, back.load, back.start, back.sweep) == (
            w.name,
            w.kv_cache_tokens,
            w.load,
            w.start,
            w.sweep,
        )
    # a result stored before the catalog (the what-if's flat form, pairs as lists) reads the same way
    old = {"name": "default", "kv_cache_tokens": 4096, "clients": 16, "prompt_len": [200, 400],
           "output_len": [100, 200], "start": 64, "sweep": [4, 6, 7, 8, 9, 10, 12, 16]}  # fmt: skip
    assert NAMED["default"].record() == old
