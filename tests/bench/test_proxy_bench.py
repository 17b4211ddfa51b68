"""The proxy bench's arithmetic: ABBA order, medians, the chunk check, and the table's verdicts."""

import pytest

from kvtune.bench.proxy import DIRECT, PROXY, RoundResult, TtftPairs, abba, format_table, summarize
from kvtune.errors import KvtuneError


def test_abba_alternates_and_balances() -> None:
    order = list(abba(4))
    assert order == [DIRECT, PROXY, PROXY, DIRECT, DIRECT, PROXY, PROXY, DIRECT]


def _rounds(direct: list[float], proxied: list[float], events: tuple[int, ...] = (5, 7)) -> list[RoundResult]:
    return [RoundResult(DIRECT, t, events, 0) for t in direct] + [
        RoundResult(PROXY, t, events, 0) for t in proxied
    ]


def test_summary_takes_medians_and_ratios() -> None:
    ttft = TtftPairs(direct=[0.010, 0.012, 0.011], proxy=[0.0105, 0.0128, 0.0118])
    s = summarize(_rounds([100.0, 90.0, 110.0], [99.0, 89.0, 150.0]), ttft)
    assert s.direct_tokens_per_s == 100.0 and s.proxy_tokens_per_s == 99.0
    assert s.throughput_ratio == pytest.approx(0.99)
    assert s.added_ttft_p50_ms == pytest.approx(0.8)
    assert s.paired_added_ttft_ms == pytest.approx(0.8)  # pairs differ by 0.5, 0.8, 0.8 ms
    assert s.chunks_equal and s.direct_events == 36 and s.proxy_events == 36
    table = format_table(s)
    assert "0.990x (goal >= 0.98: yes)" in table and "(goal < 1 ms: yes)" in table


def test_a_merged_or_split_stream_fails_the_chunk_check() -> None:
    rounds = [RoundResult(DIRECT, 100.0, (5, 7), 0), RoundResult(PROXY, 100.0, (5, 6), 0)]
    s = summarize(rounds, TtftPairs(direct=[0.01], proxy=[0.01]))
    assert not s.chunks_equal
    assert "request by request equal: NO" in format_table(s)


def test_a_side_without_results_is_an_error() -> None:
    with pytest.raises(KvtuneError, match="one round per side"):
        summarize([RoundResult(DIRECT, 1.0, (), 0)], TtftPairs([0.1], [0.1]))
    with pytest.raises(KvtuneError, match="time-to-first-token"):
        summarize(_rounds([1.0], [1.0]), TtftPairs([], [0.1]))
