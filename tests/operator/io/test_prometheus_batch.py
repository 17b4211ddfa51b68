"""Policies' instant queries to one Prometheus gathered into one (issue 38): the union's answer, split by
each policy's own matchers, is what each would have read alone, on a real Prometheus 3; and the gathering
holds under threads (one query for callers within the window, every caller woken on a failure)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.operator.io.prometheus_batch import InstantBatcher, Matcher, parse_matchers, selected, split
from kvtune.operator.io.sources import POD_LABEL, PrometheusSource
from tests.observability.live_stack import ScrapeTarget, live_stack, wait_until
from tests.operator.helpers import fixture_text, serve_bodies


def test_matchers_parse_as_promql_writes_them() -> None:
    assert parse_matchers('__name__=~"(vllm[:_].+)",server="",namespace!="b", pod!~"x\\\\.y", a="q\\"t"') == [
        Matcher("__name__", "=~", "(vllm[:_].+)"),
        Matcher("server", "=", ""),
        Matcher("namespace", "!=", "b"),
        Matcher("pod", "!~", "x\\.y"),
        Matcher("a", "=", 'q"t'),
    ]
    with pytest.raises(ValueError):
        parse_matchers("job=vllm")  # unquoted: not PromQL


def test_a_member_takes_back_only_what_its_matchers_select() -> None:
    series = [
        {"metric": {"__name__": "vllm:num_requests_running", "namespace": "a", "pod": "a-1"}},
        {"metric": {"__name__": "vllm:num_requests_running", "namespace": "b", "pod": "b-1", "server": "r"}},
    ]
    assert selected(series, parse_matchers('namespace="a",server=""')) == series[:1]
    assert (
        selected(series, parse_matchers('namespace=~"a|b",server=""')) == series[:1]
    )  # a router's copy: out
    assert selected(series, parse_matchers('pod=~"b-.*"')) == series[1:]
    assert selected(series, parse_matchers('pod=~"b"')) == []  # anchored, as Prometheus' are


def test_callers_within_the_window_share_one_query_and_a_failure_reaches_them_all() -> None:
    sent: list[str] = []

    def send(url: str, query: str, timeout: float) -> dict[str, Any]:
        sent.append(query)
        return {"resultType": "vector", "result": [{"metric": {"n": str(i)}} for i in range(8)]}

    gathered = threading.Event()
    batcher = InstantBatcher("http://prometheus", send=send, sleep=lambda _: gathered.wait(30))
    answers: dict[int, Any] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: answers.__setitem__(i, batcher.instant(f'{{n="{i}"}}', f'n="{i}"'))
        )
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: batcher.waiting() == 8, 30, "eight askers")
    gathered.set()  # the first asker's window closes with all eight in it
    for thread in threads:
        thread.join(30)
    assert len(sent) == 1 and sent[0].count(" or ") == 7, sent
    assert {i: [s["metric"]["n"] for s in answers[i]["result"]] for i in answers} == {
        i: [str(i)] for i in range(8)
    }

    failing = InstantBatcher(
        "http://prometheus", send=lambda *_: {"error": "unreachable: refused"}, sleep=lambda _: None
    )
    assert failing.instant('{n="1"}', 'n="1"') == {"error": "unreachable: refused"}


@pytest.fixture
def engines() -> Iterator[list[ScrapeTarget]]:
    """Six engines in three namespaces: vLLM's and kvtune's recorded scrapes."""
    with contextlib.ExitStack() as stack:
        targets = []
        for i, (namespace, recording) in enumerate(
            [("llama", "vllm_0_32_preempting_t1.prom"), ("llama", "vllm_0_32_preempting_t0.prom"),
             ("qwen", "kvtune_preempting_t1.prom"), ("qwen", "kvtune_preempting_t0.prom"),
             ("mixtral", "vllm_0_32_preempting_t1.prom"), ("mixtral", "kvtune_preempting_t1.prom")]
        ):  # fmt: skip
            url = stack.enter_context(contextlib.contextmanager(serve_bodies)([fixture_text(recording)]))
            targets.append(ScrapeTarget(url.removeprefix("http://"), f"{namespace}-{i}", namespace))
        yield targets


def series_of(found: Any) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    assert isinstance(found, tuple), found  # not NoData
    return {(name, tuple(sorted(labels.items()))) for name, labels, _ in found[0]}


def test_on_prometheus_3_the_batched_answers_equal_each_query_alone(
    engines: list[ScrapeTarget], tmp_path: Path
) -> None:
    selectors = ['namespace="llama"', '{namespace="qwen", pod=~"qwen-.*"}', 'namespace!="llama",namespace!="qwen"',
                 'namespace="llama",pod="llama-1"']  # fmt: skip
    no_rules = tmp_path / "rules.yaml"
    no_rules.write_text("groups: []\n")  # no recorded series appearing between one query and the next
    with live_stack(engines, tmp_path, rules=no_rules) as stack:
        alone = [PrometheusSource(stack.prometheus_url, s) for s in selectors]
        wait_until(lambda: len(stack.query("up == 1")) == len(engines), 30, "all six engines scraped")
        wait_until(lambda: all(isinstance(s.instant(), tuple) for s in alone), 30, "every selector answered")
        gathered = threading.Event()
        batcher = InstantBatcher(stack.prometheus_url, sleep=lambda _: gathered.wait(30))
        batched = [PrometheusSource(stack.prometheus_url, s, batcher=batcher) for s in selectors]
        results: dict[int, Any] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, batched[i].instant()))
                   for i in range(len(selectors))]  # fmt: skip
        for thread in threads:
            thread.start()
        wait_until(lambda: batcher.waiting() == len(selectors), 30, "all four asking")
        gathered.set()  # the first asker's window closes with all four in it
        for thread in threads:
            thread.join(30)
        assert batcher.queries == 1
        for i, source in enumerate(alone):
            assert series_of(results[i]) == series_of(source.instant()), selectors[i]
        pods = {i: {labels[POD_LABEL] for _, labels, _ in results[i][0]} for i in results}
        assert pods == {0: {"llama-0", "llama-1"}, 1: {"qwen-2", "qwen-3"}, 2: {"mixtral-4", "mixtral-5"},
                        3: {"llama-1"}}  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    series=st.lists(
        st.fixed_dictionaries({"namespace": st.sampled_from(["a", "b", "c"]), "pod": st.sampled_from(["p1", "p2", "q1"]),
                               "server": st.sampled_from(["", "", "r"]),
                               "__name__": st.sampled_from(["up", "kv", "ttft_bucket"])}),
        max_size=30,
    ),
    members=st.lists(
        st.sampled_from(['namespace="a"', 'namespace="b",pod=~"p.*"', 'pod!="p1"', 'namespace=~"a|c",server=""',
                         'namespace="c",pod="q1",server=""', 'server=""', '__name__=~"kv|ttft_bucket",namespace="a"',
                         '__name__=~"kv",namespace="a"', '__name__!="up",pod=~"p.*"']),
        min_size=1, max_size=6,
    ),
)  # fmt: skip
def test_the_one_pass_split_of_the_unions_answer_gives_each_member_what_it_selects(
    series: list[dict[str, str]], members: list[str]
) -> None:
    parsed = [parse_matchers(member) for member in members]
    everything = [{"metric": {k: v for k, v in labels.items() if v}} for labels in series]
    union = [item for item in everything if any(selected([item], matchers) for matchers in parsed)]
    result = union  # what Prometheus answers to the `or` of the members' selectors
    assert split(result, parsed) == [selected(result, matchers) for matchers in parsed]
