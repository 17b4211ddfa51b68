"""How the operator paces itself over a fleet (issue 38): the client-side token bucket, the watches' cache
of workloads and EndpointSlices, the status writes a fleet can afford, and the engines' versions kept."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.operator.io.http import VersionCache
from kvtune.operator.k8s.informer import ObjectCache
from kvtune.operator.k8s.kube_api import TokenBucket
from kvtune.operator.k8s.status_writes import StatusWrites, meaning, refresh_seconds


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@settings(max_examples=200, deadline=None)
@given(
    qps=st.floats(0.5, 100),
    burst=st.integers(1, 50),
    gaps=st.lists(st.floats(0, 2), min_size=1, max_size=200),
)
def test_the_bucket_never_lets_more_than_burst_plus_rate_through_in_any_span(
    qps: float, burst: int, gaps: list[float]
) -> None:
    clock = FakeClock()
    bucket = TokenBucket(qps, burst, clock=clock, sleep=clock.sleep)
    sent: list[float] = []
    for gap in gaps:
        clock.now += gap
        bucket.take()
        sent.append(clock.now)
    for first in range(len(sent)):
        for last in range(first, len(sent)):
            span = sent[last] - sent[first]
            assert last - first + 1 <= burst + qps * span + 1e-6


def test_the_bucket_waits_only_once_the_burst_is_spent() -> None:
    clock = FakeClock()
    bucket = TokenBucket(10, 3, clock=clock, sleep=clock.sleep)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == 0.1
    assert TokenBucket(0, 0).take() == 0.0  # no limit


def deployment(name: str, version: str, args: list[str]) -> dict[str, object]:
    return {"metadata": {"namespace": "ns", "name": name, "resourceVersion": version}, "spec": {"args": args}}


def test_the_cache_follows_the_watch_and_forgets_what_it_has_not_heard_of_for_long() -> None:
    clock = FakeClock()
    cache = ObjectCache(max_age=600, clock=clock)
    assert cache.workload("Deployment", "ns", "web") is None
    cache.saw("Deployment", None, deployment("web", "5", ["--max-num-seqs", "64"]))
    cache.saw("Deployment", "MODIFIED", deployment("web", "7", ["--max-num-seqs", "32"]))
    assert cache.workload("Deployment", "ns", "web") == deployment("web", "7", ["--max-num-seqs", "32"])
    assert cache.workload("StatefulSet", "ns", "web") is None  # kinds apart
    cache.read_through("Deployment", deployment("web", "6", []))  # an older GET never replaces the watch's
    assert cache.workload("Deployment", "ns", "web")["metadata"]["resourceVersion"] == "7"  # type: ignore[index]
    clock.now = 601
    assert cache.workload("Deployment", "ns", "web") is None  # a relisted watch never says what went
    cache.saw("Deployment", "DELETED", deployment("web", "8", []))
    clock.now = 0
    assert cache.workload("Deployment", "ns", "web") is None


def endpoint_slice(name: str, service: str) -> dict[str, object]:
    labels = {"kubernetes.io/service-name": service}
    return {"metadata": {"namespace": "ns", "name": name, "labels": labels}, "endpoints": []}


def test_the_cache_groups_endpoint_slices_by_their_service() -> None:
    cache = ObjectCache(clock=FakeClock())
    cache.saw("EndpointSlice", "ADDED", endpoint_slice("web-a", "web"))
    cache.saw("EndpointSlice", "ADDED", endpoint_slice("web-b", "web"))
    cache.saw("EndpointSlice", "ADDED", endpoint_slice("db-a", "db"))
    found = cache.endpoint_slices("ns", "web")
    assert found is not None and sorted(s["metadata"]["name"] for s in found) == ["web-a", "web-b"]  # type: ignore[index]
    cache.saw("EndpointSlice", "DELETED", endpoint_slice("web-a", "web"))
    cache.saw("EndpointSlice", "DELETED", endpoint_slice("web-b", "web"))
    assert cache.endpoint_slices("ns", "web") is None  # none seen: listed again
    assert cache.endpoint_slices("ns", "other") is None


def test_a_fleet_refreshes_unchanged_status_within_half_the_rate_limit() -> None:
    assert refresh_seconds(10, 20, 15) == 0.0  # a handful: every evaluation is written
    assert refresh_seconds(150, 20, 15) == 0.0  # 10 a second fit in half of 20
    assert refresh_seconds(500, 20, 15) == 50.0  # 500 policies at 10 writes a second
    assert refresh_seconds(500, 0, 15) == 0.0  # no limit, nothing to fit


def status(note: str, kv: float, reason: str, knob: int) -> dict[str, object]:
    return {
        "lastEvaluationTime": f"2026-12-07T00:00:{kv:02.0f}Z",
        "note": note,
        "pods": [{"name": "a", "kvUsage": kv}],
        "conditions": [{"type": "KVPressure", "status": "True", "reason": reason, "message": f"{kv} used"}],
        "current": {"maxNumSeqs": knob},
    }


def test_figures_alone_wait_for_the_refresh_and_a_change_of_meaning_is_written_at_once() -> None:
    writes = StatusWrites()
    first = status("ok", 10, "Preempting", 64)
    assert writes.due(first, 0, refresh=50)
    writes.wrote(first, 0)
    assert meaning(status("busier", 30, "Preempting", 64)) == meaning(first)
    assert not writes.due(status("busier", 30, "Preempting", 64), 15, refresh=50)
    assert writes.due(status("busier", 30, "Preempting", 64), 50, refresh=50)  # the refresh
    assert writes.due(status("ok", 10, "Quiet", 64), 15, refresh=50)  # a condition's reason moved
    assert writes.due(status("ok", 10, "Preempting", 32), 15, refresh=50)  # a knob moved
    assert writes.due(first, 15, refresh=0)  # a small fleet: every evaluation
    writes.failed()
    assert writes.due(first, 16, refresh=50)  # a failed write is retried at the next evaluation


def test_versions_are_asked_once_and_a_failure_is_asked_again() -> None:
    clock = FakeClock()
    answers: dict[str, str | None] = {"http://a": "0.32.0", "http://b": None}
    asked: list[str] = []

    def read(url: str) -> str | None:
        asked.append(url)
        return answers[url]

    cache = VersionCache(ttl=600, clock=clock, read=read)
    assert [cache.version("http://a") for _ in range(3)] == ["0.32.0"] * 3
    assert [cache.version("http://b") for _ in range(2)] == [None, None]
    assert asked == ["http://a", "http://b", "http://b"]
    clock.now = 600
    answers["http://a"] = "0.33.0"
    assert cache.version("http://a") == "0.33.0"  # a rollout to another vLLM, seen after the ttl


def test_the_caches_handlers_are_not_logged_at_every_watch_event() -> None:
    import logging

    from kvtune.operator.k8s.handlers import QuietCacheHandlers

    quiet = QuietCacheHandlers()

    def record(level: int, message: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, "", 0, message, args, None)

    assert not quiet.filter(record(logging.INFO, "Handler %r succeeded.", "cache_deployments"))
    assert quiet.filter(record(logging.ERROR, "Handler %r failed.", "cache_deployments"))  # a failure is told
    assert quiet.filter(record(logging.INFO, "no data: no series match the selector"))
