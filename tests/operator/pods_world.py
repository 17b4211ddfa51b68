"""Pods behind EndpointSlices for the emulator: a workload of local engines answering per-pod metrics, and
the policy spec that reads them."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any, Generic, Protocol, TypeVar

import kmock

from tests.operator.helpers import QuietHandler, fixture_text, reply
from tests.operator.kmock_world import NS, OptimisticEmulator, fast_policy

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

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class PodHandler(QuietHandler):
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


class Pod(Protocol):
    def close(self) -> None: ...


PodT = TypeVar("PodT", bound=Pod)


class Pods(Generic[PodT]):
    """The pods of Service `llama`, and the EndpointSlice that lists them, ready, in kmock: what a replaced
    pod changes. A subclass starts its kind of pod and names the ports the slice lists."""

    def __init__(self, emulator: OptimisticEmulator) -> None:
        self.kube = emulator
        self.pods: dict[str, PodT] = {}
        self.addresses: dict[str, str] = {}

    def add(self, name: str, address: str, pod: PodT) -> PodT:
        self.pods[name] = pod
        self.addresses[name] = address
        self.publish()
        return pod

    def stop(self, name: str) -> None:
        self.pods.pop(name).close()
        del self.addresses[name]
        self.publish()

    def ports(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def publish(self) -> None:
        self.kube.objects[SLICES, NS, "llama-abcde"] = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "llama-abcde", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": "llama"}},
            "addressType": "IPv4",
            "ports": self.ports(),
            "endpoints": [
                {"addresses": [address], "conditions": {"ready": True},
                 "targetRef": {"kind": "Pod", "name": name, "namespace": NS}}
                for name, address in sorted(self.addresses.items())
            ],
        }  # fmt: skip

    def close(self) -> None:
        for name in list(self.pods):
            self.stop(name)


class Workload(Pods[PodEngine]):
    """A kvtune engine's pods, each one engine on one port."""

    def __init__(self, emulator: OptimisticEmulator, port: int) -> None:
        super().__init__(emulator)
        self.port = port

    def start(self, name: str, address: str, preemptions: list[float]) -> PodEngine:
        return self.add(name, address, PodEngine(address, self.port, preemptions))

    def ports(self) -> list[dict[str, Any]]:
        return [{"name": "http", "port": self.port, "protocol": "TCP"}]


def kvtune_spec(port: int, mode: str = "Apply") -> dict[str, Any]:
    target = {"name": "llama", "engine": "kvtune", "adminTokenSecretRef": {"name": "llama-admin"},
              "podEndpoints": {"service": "llama", "metricsPort": port}}  # fmt: skip
    return fast_policy(target, mode)
