"""Findings are told at their edges (issue 39): one report when a finding starts, one at each change, one
when it ends, and nothing while it stays as it was; a kind not looked at keeps what it was."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvtune.operator.decide.findings import ENDED, STARTED, Fact, Finding, FindingKind, transitions

KINDS: list[FindingKind] = list(STARTED)
LEFT_OUT = "left out"  # the kind was not looked at this tick
looks = st.sampled_from([LEFT_OUT, None, Fact("", "on"), Fact("a", "a"), Fact("b", "b")])
sequences = st.lists(st.dictionaries(st.sampled_from(KINDS), looks), max_size=12)


@given(sequences)
def test_a_finding_is_told_when_it_starts_changes_and_ends_never_twice_the_same(ticks: list[dict]) -> None:
    on: dict[FindingKind, str] = {}
    told: dict[FindingKind, list[Finding]] = {kind: [] for kind in KINDS}
    for looked in ticks:
        facts = {kind: fact for kind, fact in looked.items() if fact != LEFT_OUT}
        before = dict(on)
        after, findings = transitions(on, facts)
        assert on == before, "the memory passed in is not changed"
        on = after
        assert [f.kind for f in findings] == [k for k in facts if k in {f.kind for f in findings}]
        for finding in findings:
            told[finding.kind].append(finding)
        for kind in KINDS:
            if kind not in facts:
                assert on.get(kind) == before.get(kind)
            else:
                fact = facts[kind]
                assert on.get(kind) == (None if fact is None else fact.key)
                assert len([f for f in findings if f.kind == kind]) == int(before.get(kind) != on.get(kind))
    for reports in told.values():
        for earlier, later in itertools.pairwise(reports):
            assert not (earlier.edge == "ended" and later.edge == "ended"), "never ended twice in a row"
            assert later.edge != "changed" or earlier.edge != "ended", "a change only while it holds"
            assert later.edge != "started" or earlier.edge == "ended", "started again only after it ended"
        if reports:
            assert reports[0].edge == "started"


def test_the_words_of_each_edge() -> None:
    on, found = transitions({}, {"no_data": Fact("", "connection refused")})
    assert found == [Finding("no_data", "started", "no data from the metrics source: connection refused")]
    on, found = transitions(on, {"no_data": Fact("", "timed out")})
    assert found == [], "a steady finding does not change with its words"
    on, found = transitions(on, {})
    assert (on, found) == ({"no_data": ""}, []), "not looked at: kept"
    on, found = transitions(on, {"no_data": None})
    assert (on, found) == ({}, [Finding("no_data", "ended", ENDED["no_data"])])
