"""A change lands within one interval of the data it was decided on, or is not made (issue 38: etcd
restarted with the operator's patch in flight let it land 5.7 s after its data). The rule is pure
(`k8s.bounded_patch.Freshness`); the Deployment-args actuator checks it before each read and before the patch, and
the patch itself carries the deadline to the API server (`timeout`), which gives it up then, and is never
retried by the client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.operator.k8s.bounded_patch import Freshness
from kvtune.operator.k8s.kube_api import KubeApi, KubeError
from kvtune.operator.k8s.workload_actuator import WorkloadArgsActuator
from tests.operator.helpers import QuietHandler, reply, serving


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def deployment(value: int) -> dict[str, Any]:
    return {"metadata": {"name": "llama", "resourceVersion": "7", "generation": 1},
            "spec": {"template": {"spec": {"containers": [
                {"name": "vllm", "image": "vllm/vllm-openai:v0.6.0", "args": ["--max-num-seqs", str(value)]}]}}}}  # fmt: skip


class SlowApi:
    """A KubeApi stand-in whose reads take `read_s` of the fake clock; records every patch and its deadline."""

    def __init__(self, clock: Clock, read_s: float = 0.0, patch_error: KubeError | None = None) -> None:
        self.clock, self.read_s, self.patch_error = clock, read_s, patch_error
        self.patches: list[tuple[dict[str, Any], float | None]] = []

    def read_workload(self, kind: str, namespace: str, name: str, fresh: bool = False) -> dict[str, Any]:
        self.clock.now += self.read_s
        return deployment(64)

    def patch_workload(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                       deadline: float | None = None) -> dict[str, Any]:  # fmt: skip
        self.patches.append((patch, deadline))
        if self.patch_error is not None:
            self.clock.now += 2.0  # the API server held it, then gave it up
            raise self.patch_error
        return deployment(48) | {"metadata": {"generation": 2}}


def actuator(api: SlowApi, freshness: Freshness | None) -> WorkloadArgsActuator:
    made = WorkloadArgsActuator(api, "Deployment", "ns", "llama", None, "vllm", admission="MaxNumSeqs")  # type: ignore[arg-type]
    if freshness is not None:
        made.decides_on(freshness, api.clock)
    return made


def test_the_rule_holds_data_for_one_interval() -> None:
    fresh = Freshness(read_at=100.0, interval_s=5.0)
    assert fresh.deadline == 105.0
    assert fresh.stale(100.0) is None and fresh.stale(104.9) is None
    assert fresh.remaining(103.0) == pytest.approx(2.0)
    told = fresh.stale(105.7)
    assert told == ("decided on data 5.7 s old, more than one interval (5 s): not applied; the next evaluation "
                    "decides again")  # fmt: skip


def test_a_patch_on_fresh_data_carries_its_deadline() -> None:
    clock = Clock(1000.0)
    api = SlowApi(clock, read_s=0.1)
    result = actuator(api, Freshness(1000.0, 1.0)).apply(KNOB_MAX_NUM_SEQS, 48)
    assert result.ok and result.values == {KNOB_MAX_NUM_SEQS: 48}, result
    ((patch, deadline),) = api.patches
    assert deadline == 1001.0  # the API server gives it up then
    assert patch["spec"]["template"]["spec"]["containers"][0]["args"] == ["--max-num-seqs", "48"]


def test_data_older_than_one_interval_is_not_patched() -> None:
    clock = Clock(1000.0)
    api = SlowApi(clock, read_s=1.5)  # the API server slow to answer the read before the patch
    result = actuator(api, Freshness(1000.0, 1.0)).apply(KNOB_MAX_NUM_SEQS, 48)
    assert not result.ok and api.patches == []
    assert result.error == ("deployment ns/llama: decided on data 1.5 s old, more than one interval (1 s): not "
                            "applied; the next evaluation decides again")  # fmt: skip


def test_stale_before_the_read_is_not_even_read() -> None:
    clock = Clock(1002.0)
    api = SlowApi(clock)
    result = actuator(api, Freshness(1000.0, 1.0)).apply(KNOB_MAX_NUM_SEQS, 48)
    assert not result.ok and "2.0 s old" in str(result.error) and api.patches == []


def test_a_patch_the_api_server_gave_up_on_says_why() -> None:
    clock = Clock(1000.0)
    api = SlowApi(clock, patch_error=KubeError(504, "Timeout", "PATCH Deployment ns/llama: timed out"))
    result = actuator(api, Freshness(1000.0, 1.0)).apply(KNOB_MAX_NUM_SEQS, 48)
    assert not result.ok and len(api.patches) == 1
    assert "HTTP 504 Timeout" in str(
        result.error
    ) and "not applied; the next evaluation decides again" in str(result.error)


def test_without_a_freshness_bound_the_patch_is_unbounded() -> None:
    api = SlowApi(Clock(1000.0), read_s=30.0)
    assert actuator(api, None).apply(KNOB_MAX_NUM_SEQS, 48).ok
    assert [deadline for _, deadline in api.patches] == [None]


class ApiServer(QuietHandler):
    """Answers each PATCH with the next status of `server.answers` (then 200 and a Deployment); records the
    path and query of each."""

    def do_PATCH(self) -> None:
        server: Any = self.server
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server.seen.append((self.path, self.headers.get("Authorization"), self.headers.get("Content-Type")))
        status = server.answers.pop(0) if server.answers else 200
        body = deployment(48) if status == 200 else {"kind": "Status", "reason": "Timeout",
                                                     "message": "request did not complete within 900ms"}  # fmt: skip
        reply(self, status, "application/json", json.dumps(body).encode())


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    with serving(ApiServer, seen=[], answers=[]) as httpd:
        yield httpd


def kube_api(server: ThreadingHTTPServer) -> KubeApi:
    def load() -> client.Configuration:
        configuration = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
        configuration.api_key = {"authorization": "Bearer current"}
        return configuration

    return KubeApi(load, timeout=5.0)


def test_the_deadline_goes_to_the_api_server_and_a_timeout_is_not_retried(
    server: ThreadingHTTPServer,
) -> None:
    seen: list[Any] = server.seen  # type: ignore[attr-defined]
    with kube_api(server) as api:
        patched = api.patch_workload("Deployment", "ns", "llama", {"spec": {}}, deadline=time.time() + 0.9)
        assert patched["metadata"]["name"] == "llama"
        ((path, token, content_type),) = seen
        url = urlparse(path)
        assert url.path == "/apis/apps/v1/namespaces/ns/deployments/llama"
        query = parse_qs(url.query)
        assert query["fieldManager"] == ["kvtune"]
        (timeout,) = query["timeout"]
        assert timeout.endswith("ms") and 0 < int(timeout[:-2]) <= 900, timeout
        assert (token, content_type) == ("Bearer current", "application/merge-patch+json")

        server.answers = [504, 504]  # type: ignore[attr-defined]
        with pytest.raises(KubeError) as refused:
            api.patch_workload("Deployment", "ns", "llama", {"spec": {}}, deadline=time.time() + 0.9)
        assert refused.value.status == 504 and len(seen) == 2  # once: a retry would land after the deadline

        with pytest.raises(KubeError) as late:
            api.patch_workload("Deployment", "ns", "llama", {"spec": {}}, deadline=time.time() - 0.5)
        assert "deadline passed" in str(late.value) and len(seen) == 2  # never sent
