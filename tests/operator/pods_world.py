"""Pods behind EndpointSlices for the emulator: a workload of local engines answering per-pod metrics,
the policy spec that reads them, and the tick and Event-reason helpers those tests share."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kmock

from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.kube_api import KubeApi
from kvtune.operator.k8s.reconcile import Outcome, PolicyMemory, PolicyTick, run_once
from tests.operator.helpers import fixture_text, reply
from tests.operator.kmock_world import (
    NS,
    OptimisticEmulator,
    our_events,
)

SLICES = kmock.resource("discovery.k8s.io/v1/endpointslices")


PREEMPTIONS_LINE = re.compile(r"^(vllm:num_preemptions_total\{.*\}) \S+$", re.M)


MAX_NUM_SEQS_LINE = re.compile(r"^(kvtune:max_num_seqs\{.*\}) \S+$", re.M)


class PodEngine(ThreadingHTTPServer):
    """One pod: the recorded kvtune scrape (t0 first, t1 after) with this pod's preemption counts, its live
    max_num_seqs and process start time; and a kvtune admin API that records every PATCH."""

    def __init__(self, address: str, port: int, preemptions: list[float]) -> None:
        super().__init__((address, port), PodHandler)
        self.preemptions = preemptions
        self.reads = 0
        self.knobs: dict[str, int | None] = {"max_num_seqs": 64, "max_tokens_cap": None}
        self.patches: list[dict[str, Any]] = []
        self.started = time.time()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def metrics(self) -> str:
        text = fixture_text("kvtune_preempting_t0.prom" if self.reads == 0 else "kvtune_preempting_t1.prom")
        count = self.preemptions[min(self.reads, len(self.preemptions) - 1)]
        self.reads += 1
        text = PREEMPTIONS_LINE.sub(lambda found: f"{found.group(1)} {count}", text)
        text = MAX_NUM_SEQS_LINE.sub(lambda found: f"{found.group(1)} {self.knobs['max_num_seqs']}", text)
        return text + f"process_start_time_seconds {self.started}\n"


class PodHandler(BaseHTTPRequestHandler):
    server: PodEngine

    def do_GET(self) -> None:
        if self.path == "/admin/config":
            reply(self, 200, "application/json", json.dumps(self.server.knobs).encode())
        else:
            reply(self, 200, "text/plain; version=0.0.4", self.server.metrics().encode())

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.patches.append(body)
        self.server.knobs.update(body)
        reply(self, 200, "application/json", json.dumps(self.server.knobs).encode())

    def log_message(self, *args: Any) -> None:
        pass


def free_port(addresses: list[str]) -> int:
    """A port free on every address (the pods listen on the same port, each on its own address)."""
    for _ in range(50):
        probe = socket.socket()
        probe.bind((addresses[0], 0))
        port = int(probe.getsockname()[1])
        held = [probe]
        try:
            for address in addresses[1:]:
                other = socket.socket()
                held.append(other)
                other.bind((address, port))
            return port
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no port free on every loopback address")


class Workload:
    """The pods of one Service: their engines, and the EndpointSlice that lists them in kmock."""

    def __init__(self, emulator: OptimisticEmulator, port: int) -> None:
        self.kube = emulator
        self.port = port
        self.pods: dict[str, PodEngine] = {}
        self.addresses: dict[str, str] = {}

    def start(self, name: str, address: str, preemptions: list[float]) -> PodEngine:
        self.pods[name] = PodEngine(address, self.port, preemptions)
        self.addresses[name] = address
        self.publish()
        return self.pods[name]

    def stop(self, name: str) -> None:
        engine = self.pods.pop(name)
        del self.addresses[name]
        engine.shutdown()
        engine.server_close()
        self.publish()

    def publish(self) -> None:
        self.kube.objects[SLICES, NS, "llama-abcde"] = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "llama-abcde", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": "llama"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": self.port, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [address], "conditions": {"ready": True},
                 "targetRef": {"kind": "Pod", "name": name, "namespace": NS}}
                for name, address in sorted(self.addresses.items())
            ],
        }  # fmt: skip

    def close(self) -> None:
        for name in list(self.pods):
            self.stop(name)


def kvtune_spec(port: int, mode: str = "Apply") -> dict[str, Any]:
    return {
        "target": {
            "name": "llama",
            "engine": "kvtune",
            "adminTokenSecretRef": {"name": "llama-admin"},
            "podEndpoints": {"service": "llama", "metricsPort": port},
        },
        "mode": mode,
        "bounds": {"minMaxNumSeqs": 2, "maxMaxNumSeqs": 256},
        "intervalSeconds": 1,
        "evaluationWindowSeconds": 30,
        "cooldownSeconds": 0,
        "prediction": False,  # the ladder's first action on a two-sample window (the predicted move needs 5 s)
    }


async def ticks(spec: dict[str, Any], memory: PolicyMemory, count: int) -> list[Outcome]:
    parsed = KVTuningPolicySpec.model_validate(spec)
    ref = PolicyRef(NS, "llama", "uid-llama")

    def run() -> list[Outcome]:
        outcomes = []
        with KubeApi.from_environment() as api:
            for index in range(count):
                if index:
                    time.sleep(0.3)
                outcomes.append(run_once(api, PolicyTick(ref, parsed, time.time()), memory))
        return outcomes

    return await asyncio.to_thread(run)


def reasons(kube: OptimisticEmulator) -> list[str]:
    return [event["reason"] for event in our_events(kube)]
