"""The prefix-defeat detector on hand-built prompts: each reason with its positions, clean traffic unflagged,
properties of its state and counts, and the memory bound over 100,000 prompts."""

from __future__ import annotations

import json
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.bench.proxy import shared_document
from kvtune.core.prefix_defeats import REASONS, DetectorLimits, PrefixDefeatDetector, fix_for

HEADER = [32001, 32002, 32003, 32004, 32005]  # a 5-token chat-template header


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 32_000) for _ in range(n)]


def test_a_timestamp_at_the_head_is_a_varying_head_with_its_span() -> None:
    rng = random.Random(1)
    system = words(rng, 300)
    det = PrefixDefeatDetector(16)
    assert det.observe("m", [*HEADER, *words(rng, 10), *system, *words(rng, 20)]) is None
    finding = det.observe("m", [*HEADER, *words(rng, 10), *system, *words(rng, 20)])
    assert finding is not None and finding.reason == "varying_head"
    assert (finding.span_start, finding.span_length, finding.shared_start) == (5, 10, 15)
    assert 290 <= finding.shared_length <= 300
    assert finding.tokens_lost == (5 + finding.shared_length) // 16 * 16
    assert finding.span_token_ids is None and len(finding.prompt_hash) == 16


def test_a_document_after_a_variable_preamble_is_misaligned_with_its_shift() -> None:
    rng = random.Random(2)
    doc = words(rng, 400)
    det = PrefixDefeatDetector(16)
    det.observe("m", [*HEADER, *words(rng, 50), *doc, *words(rng, 10)])
    finding = det.observe("m", [*HEADER, *words(rng, 170), *doc, *words(rng, 10)])
    assert finding is not None and finding.reason == "misaligned"
    assert finding.offset_shift == 120 and finding.span_start == 5
    assert 175 <= finding.shared_start <= 175 + 16 and finding.shared_length >= 380
    assert finding.to_json()["offset_shift_mod_block"] == 120 % 16


def test_a_shared_prefix_under_one_block_is_reported_with_its_length() -> None:
    rng = random.Random(3)
    system = words(rng, 7)
    det = PrefixDefeatDetector(16)
    det.observe("m", [*HEADER, *system, *words(rng, 40)])
    finding = det.observe("m", [*HEADER, *system, *words(rng, 40)])
    assert finding is not None and finding.reason == "shorter_than_block"
    assert (finding.span_start, finding.span_length, finding.tokens_lost) == (0, 12, 12)
    assert "12 tokens, under one block of 16" in fix_for("shorter_than_block", 16, finding)


def test_a_per_request_salt_on_identical_prompts_is_salted() -> None:
    prompt = [*HEADER, *words(random.Random(4), 100)]
    det = PrefixDefeatDetector(16)
    assert det.observe("m", prompt, cache_salt="a") is None
    assert det.observe("m", prompt, cache_salt="a") is None  # one salt per tenant: it hits
    finding = det.observe("m", prompt, cache_salt="b")
    assert finding is not None and finding.reason == "salted"
    assert (finding.span_start, finding.span_length, finding.tokens_lost) == (0, 96, 96)


def test_blocks_the_engine_missed_are_evicted_with_their_age() -> None:
    now = [100.0]
    prompt = [*HEADER, *words(random.Random(5), 100)]
    det = PrefixDefeatDetector(16, clock=lambda: now[0])
    det.observe("m", prompt, cached_tokens=0)
    now[0] = 142.5
    finding = det.observe("m", prompt, cached_tokens=32)
    assert finding is not None and finding.reason == "evicted"
    assert (finding.span_start, finding.span_length, finding.shared_length) == (32, 64, 96)
    assert finding.since_last_use_s == pytest.approx(42.5)
    assert det.observe("m", prompt, cached_tokens=96) is None


def test_clean_shared_prefixes_unrelated_prompts_and_other_keys_are_not_flagged() -> None:
    rng = random.Random(6)
    system = words(rng, 200)
    det = PrefixDefeatDetector(16)
    for _ in range(20):
        assert det.observe("m", [*HEADER, *system, *words(rng, rng.randint(5, 200))]) is None
        assert det.observe("m", [*HEADER, *words(rng, rng.randint(5, 300))]) is None
    assert det.observe("other", [*HEADER, *words(rng, 10), *system]) is None  # nothing earlier under this key
    assert det.counts() == {reason: (0, 0) for reason in REASONS}


def test_the_report_is_json_with_examples_fixes_and_opt_in_span_tokens() -> None:
    rng = random.Random(7)
    system = words(rng, 100)
    det = PrefixDefeatDetector(16, DetectorLimits(examples_per_reason=2), keep_span_tokens=True)
    spans = [words(rng, 6) for _ in range(4)]
    for span in spans:
        det.observe("m", [*HEADER, *span, *system])
    report = json.loads(json.dumps(det.report()))
    assert report["observed"] == 4 and report["keys"] == 1 and report["block_size"] == 16
    varying = report["reasons"]["varying_head"]
    assert varying["defeats"] == 3 and len(varying["examples"]) == 2
    assert varying["examples"][-1]["span_token_ids"] == spans[-1]
    assert set(report["fixes"]) == set(REASONS) and "tokens 5-10" in report["fixes"]["varying_head"]
    assert report["limits"]["max_state_entries"] == DetectorLimits(examples_per_reason=2).max_state_entries()


def test_bad_limits_and_block_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixDefeatDetector(0)
    with pytest.raises(ValueError, match="max_keys"):
        DetectorLimits(max_keys=0)


SMALL = DetectorLimits(
    max_keys=2, max_blocks_per_key=40, max_prefixes_per_key=40, max_anchors_per_key=60, max_runs_per_key=4
)
prompts = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 40), min_size=0, max_size=120),
        st.sampled_from([None, "s1", "s2"]),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(prompts)
def test_state_stays_bounded_and_counts_only_grow(stream: list[tuple[str, list[int], str | None]]) -> None:
    det = PrefixDefeatDetector(8, SMALL)
    before = det.counts()
    for key, ids, salt in stream:
        det.observe(key, ids, cache_salt=salt)
        assert det.state_entries() <= SMALL.max_state_entries()
        after = det.counts()
        assert all(after[r][0] >= before[r][0] and after[r][1] >= before[r][1] for r in REASONS)
        before = after
    assert det.observed == len(stream)


@settings(max_examples=60, deadline=None)
@given(prompts, st.lists(st.integers(0, 40), min_size=1, max_size=150))
def test_a_prompt_identical_to_the_previous_one_is_never_flagged(
    stream: list[tuple[str, list[int], str | None]], prompt: list[int]
) -> None:
    det = PrefixDefeatDetector(8, SMALL)
    for key, ids, salt in stream:
        det.observe(key, ids, cache_salt=salt)
    det.observe("a", prompt)
    assert det.observe("a", prompt) is None


MEMORY_LIMITS = DetectorLimits(
    max_keys=4,
    max_blocks_per_key=512,
    max_prefixes_per_key=512,
    max_anchors_per_key=1024,
    max_runs_per_key=32,
)


def test_a_hundred_thousand_prompts_stay_under_the_entry_bound() -> None:
    rng = random.Random(8)
    shared = [words(rng, 8) for _ in range(8)]
    det = PrefixDefeatDetector(4, MEMORY_LIMITS)
    for i in range(100_000):
        tail = [rng.randrange(100, 32_000), rng.randrange(100, 32_000)]
        det.observe(f"key-{i % 6}", [*shared[i % 8], *tail] if i % 3 else [*tail, *shared[i % 8]])
    assert det.observed == 100_000
    assert det.state_entries() <= MEMORY_LIMITS.max_state_entries()


def test_a_full_detector_stays_under_the_stated_byte_bound() -> None:
    """tracemalloc slows every allocation tenfold, so the bytes are measured on fewer, longer prompts that fill
    every map past its cap (the entry test above covers the 100,000 prompts)."""
    rng = random.Random(9)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        det = PrefixDefeatDetector(16, MEMORY_LIMITS)
        for i in range(1200):
            det.observe(f"key-{i % 4}", [*HEADER, *words(rng, 70)], cache_salt=f"s{i}" if i % 2 else None)
        held = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert (
        det.state_entries() >= 0.9 * MEMORY_LIMITS.max_state_entries() - 25
    )  # full: the bound is what is measured
    assert held <= MEMORY_LIMITS.max_state_bytes()


def byte_ids(text: str) -> list[int]:
    return [1, *text.encode()]


def test_repetitive_text_lining_up_by_chance_is_not_a_shared_run() -> None:
    """A document seen with a timestamp at its head, then another document (same ten words) with the
    timestamp at its end: the second shares nothing with the first, however many 12-grams recur."""
    detector = PrefixDefeatDetector(32)
    first, second = shared_document(0, 2000), shared_document(1, 2000)
    heads = [detector.observe("chat", byte_ids(f"[14:00:{i:02d} req-{i:04d}] {first}")) for i in range(8)]
    assert [f.reason if f else None for f in heads] == [None] + ["varying_head"] * 7
    tails = [detector.observe("chat", byte_ids(f"{second} [14:00:{i:02d} req-{i:04d}]")) for i in range(8)]
    assert tails == [None] * 8
