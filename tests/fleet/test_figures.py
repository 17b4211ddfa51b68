"""What `kvtune bench fleet` reads from kube-apiserver's and the operator's /metrics and from /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtune.bench.fleet_figures import (
    cpu_seconds,
    evaluation_times,
    failures,
    own_requests_by_verb,
    prometheus_queries,
    quantile,
    rates,
    requests_by_verb,
    rss_bytes,
    watches_held,
)

APISERVER = """# HELP apiserver_request_total [STABLE] Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",dry_run="",group="kvtune.dev",resource="kvtuningpolicies",scope="resource",subresource="status",verb="PATCH",version="v1alpha1"} 40
apiserver_request_total{code="200",component="apiserver",dry_run="",group="discovery.k8s.io",resource="endpointslices",scope="namespace",subresource="",verb="LIST",version="v1"} 12
apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="events",scope="resource",subresource="",verb="POST",version="v1"} 3
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 900
apiserver_request_total_other{verb="GET"} 5
# TYPE apiserver_longrunning_requests gauge
apiserver_longrunning_requests{component="apiserver",group="kvtune.dev",resource="kvtuningpolicies",scope="namespace",subresource="",verb="WATCH",version="v1alpha1"} 10
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="cluster",subresource="",verb="WATCH",version="v1"} 4
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="resource",subresource="log",verb="CONNECT",version="v1"} 1
"""


def test_requests_by_verb_on_the_operators_resources_only() -> None:
    assert requests_by_verb(APISERVER) == {"PATCH": 40.0, "LIST": 12.0, "POST": 3.0}
    assert requests_by_verb(APISERVER, frozenset())["PUT"] == 900.0  # every resource when asked
    later = requests_by_verb(APISERVER.replace("} 40", "} 100"))
    assert rates(requests_by_verb(APISERVER), later, 30.0) == {"PATCH": 2.0}


def test_watches_held_by_resource() -> None:
    assert watches_held(APISERVER) == {"kvtuningpolicies": 10.0, "pods": 4.0}


def test_the_quantile_of_what_a_histogram_saw_between_two_readings() -> None:
    before = {0.1: 5.0, 1.0: 5.0, 10.0: 5.0, float("inf"): 5.0}
    after = {0.1: 5.0, 1.0: 55.0, 10.0: 104.0, float("inf"): 105.0}  # 50 in (0.1, 1], 49 in (1, 10], 1 above
    assert quantile(0.5, before, after) == pytest.approx(1.0)
    assert quantile(0.25, before, after) == pytest.approx(0.1 + 0.9 * 0.5)
    assert quantile(0.999, before, after) == 10.0  # in +Inf: the highest finite bound
    assert quantile(0.5, after, after) is None  # nothing observed in between


def test_evaluation_times_per_policy() -> None:
    text = ('kvtune_operator_last_evaluation_timestamp_seconds{namespace="a",policy="p"} 1.7e+09\n'
            'kvtune_operator_last_evaluation_timestamp_seconds{namespace="b",policy="q"} 1.8e+09\n')  # fmt: skip
    assert evaluation_times(text) == {("a", "p"): 1.7e9, ("b", "q"): 1.8e9}


def test_failures_summed_over_policies_by_kind() -> None:
    text = ('kvtune_operator_errors_total{kind="status_write",namespace="a",policy="p"} 2.0\n'
            'kvtune_operator_errors_total{kind="status_write",namespace="b",policy="q"} 1.0\n'
            'kvtune_operator_errors_total{kind="kubernetes",namespace="b",policy="q"} 0.0\n'
            'kvtune_operator_no_data_total{namespace="a",policy="p"} 4.0\n')  # fmt: skip
    assert failures(text) == {"status_write": 3.0, "kubernetes": 0.0, "no_data": 4.0}


def test_cpu_and_memory_of_this_process_from_proc() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    assert cpu_seconds("42 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 250 150 0 0", 100) == 4.0
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    assert 0 < cpu_seconds(stat, ticks) <= os.times().user + os.times().system + 0.05
    assert rss_bytes(Path(f"/proc/{os.getpid()}/status").read_text()) > 10 * 2**20


def test_prometheus_queries_by_handler() -> None:
    text = ('prometheus_http_requests_total{code="200",handler="/api/v1/query"} 7\n'
            'prometheus_http_requests_total{code="400",handler="/api/v1/query"} 1\n'
            'prometheus_http_requests_total{code="200",handler="/api/v1/query_range"} 20\n'
            'prometheus_http_requests_total{code="200",handler="/metrics"} 99\n')  # fmt: skip
    assert prometheus_queries(text) == {"/api/v1/query": 8.0, "/api/v1/query_range": 20.0}


def test_the_operators_own_requests_by_verb_over_codes() -> None:
    text = (
        'kvtune_operator_kube_api_requests_total{code="200",verb="PATCH"} 7.0\n'
        'kvtune_operator_kube_api_requests_total{code="409",verb="PATCH"} 1.0\n'
        'kvtune_operator_kube_api_requests_total{code="201",verb="POST"} 2.0\n'
        'kvtune_operator_kube_api_requests_created{code="201",verb="POST"} 1.7e9\n'
    )
    assert own_requests_by_verb(text) == {"PATCH": 8.0, "POST": 2.0}
