"""The fleet's replayed engines: the first loop in the recorded bytes, every later one carrying each
cumulative series on, so that no counter of any pod ever falls however long the replay runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvtune.bench.fleet_replay import (
    Replay,
    is_cumulative,
    metric_kinds,
    replay_of,
    sample_parts,
    split_recording,
)

REPO = Path(__file__).resolve().parents[2]
RECORDINGS = sorted((REPO / "docs" / "examples").glob("*.prom"))  # vLLM's and kvtune's engines, recorded


def cumulative_values(replay: Replay, body: bytes) -> dict[str, float]:
    """Every cumulative sample of a rendered scrape, by series, as Prometheus' own parser reads it."""
    kinds: dict[str, str] = {}
    text = body.decode()
    kinds.update(metric_kinds(text))
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.type in ("counter", "histogram", "summary") and not sample.name.endswith("_created"):
                if family.type == "summary" and "quantile" in sample.labels:
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda path: path.stem)
def test_the_first_loop_is_the_recording_byte_for_byte(recording: Path) -> None:
    text = recording.read_text()
    replay = replay_of(recording.stem, text)
    scrapes = split_recording(text)
    assert replay.scrapes == len(scrapes) == 6
    for index, scrape in enumerate(scrapes):
        assert replay.render(0, index) == scrape.text.encode()


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda path: path.stem)
def test_a_real_recording_never_falls_across_loops(recording: Path) -> None:
    replay = replay_of(recording.stem, recording.read_text())
    last: dict[str, float] = {}
    rising = set()
    for loop in range(4):
        for index in range(replay.scrapes):
            now = cumulative_values(replay, replay.render(loop, index))
            assert now, "no cumulative series found"
            for series, value in now.items():
                assert value >= last.get(series, float("-inf")), (series, loop, index)
                if value > last.get(series, value):
                    rising.add(series)
            last.update(now)
    preempting = any(series.startswith("vllm:num_preemptions_total{") for series in rising)
    assert preempting == recording.stem.endswith("preempting")  # a preempting engine goes on preempting


def test_label_values_with_spaces_and_braces_are_kept_whole() -> None:
    line = 'vllm:cache_config_info{note="a } b \\" c",block_size="32"} 1.0\n'
    assert sample_parts(line) == ('vllm:cache_config_info{note="a } b \\" c",block_size="32"}', "1.0", "\n")
    assert sample_parts("# HELP x y\n") is None
    assert sample_parts("plain 3 1700000000\n") == ("plain", "3", " 1700000000\n")


def test_which_samples_are_cumulative() -> None:
    kinds = {"a_total": "counter", "b": "counter", "h": "histogram", "s": "summary", "g": "gauge"}
    assert is_cumulative("a_total", kinds) and is_cumulative("b_total", kinds)
    assert (
        is_cumulative("h_bucket", kinds) and is_cumulative("h_sum", kinds) and is_cumulative("s_count", kinds)
    )
    assert (
        not is_cumulative("g", kinds)
        and not is_cumulative("s", kinds)
        and not is_cumulative("h_created", kinds)
    )


def test_position_walks_the_recorded_offsets_and_wraps() -> None:
    recording = "".join(f"# scraped_at {100 + at}\nx_total 1\n" for at in (0.0, 2.0, 5.0))
    replay = replay_of("r", recording)
    assert replay.offsets == (0.0, 2.0, 5.0) and replay.period == 7.5
    assert [replay.position(t) for t in (0.0, 1.9, 2.0, 4.9, 5.0, 7.4, 7.5, 9.6)] == [
        (0, 0), (0, 0), (0, 1), (0, 1), (0, 2), (0, 2), (1, 0), (1, 1)]  # fmt: skip


# a recording: per scrape, each counter's value or None (absent from that scrape), and a gauge
counter_runs = st.lists(
    st.lists(st.one_of(st.none(), st.floats(0, 1e9, allow_nan=False)), min_size=1, max_size=3),
    min_size=1,
    max_size=6,
)


def recording_of(runs: list[list[float | None]]) -> str:
    parts = []
    for index, values in enumerate(runs):
        lines = ["# HELP c_total a counter\n# TYPE c_total counter\n"]
        lines += [f'c_total{{pod="{i}"}} {v!r}\n' for i, v in enumerate(values) if v is not None]
        lines.append(f'# TYPE h histogram\nh_bucket{{le="+Inf"}} {index}.0\nh_count {index}.0\n')
        lines.append(f"# TYPE g gauge\ng {-index}.5\n")
        parts.append(f"# scraped_at {1000 + 2 * index}\n{''.join(lines)}")
    return "".join(parts)


@settings(max_examples=200, deadline=None)
@given(runs=counter_runs, positions=st.lists(st.floats(0, 1e5, allow_nan=False), min_size=2, max_size=30))
def test_no_counter_of_any_pod_ever_falls(runs: list[list[float | None]], positions: list[float]) -> None:
    """Whatever the recording (counters that fall, vanish, reappear), sampled at any times in order, over
    any number of loops, every cumulative series read back is non-decreasing."""
    replay = replay_of("r", recording_of(runs))
    last: dict[str, float] = {}
    for elapsed in sorted(positions):
        loop, index = replay.position(elapsed)
        for series, value in cumulative_values(replay, replay.render(loop, index)).items():
            assert value >= last.get(series, float("-inf")), (series, loop, index, last)
            last[series] = value


@given(times=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=2, max_size=20))
def test_time_never_moves_a_replay_backwards(times: list[float]) -> None:
    replay = replay_of("r", "".join(f"# scraped_at {at}\nx_total 1\n" for at in (0.0, 1.5, 4.0, 4.0, 9.0)))
    positions = [replay.position(t) for t in sorted(times)]
    assert positions == sorted(positions)
