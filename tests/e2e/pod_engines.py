"""Real engines for whatever pods a workload has now: a watch on the pods of a label selector starts one
`kvtune serve` in the run's pod network (pod_network.py) for each pod kwok runs, at an address of its own,
and sets the pod's `status.podIP` there, as a kubelet and a CNI would; a pod that goes takes its engine with
it. So a Deployment that something scales (an autoscaler, a test as one) has an engine behind every pod's IP,
where the operator and Prometheus look.

kwok sets a pod's IP once, when its pod-ready stage makes a Pending pod Running; its pod-delete stage deletes
a pod as soon as it has a deletionTimestamp. The IP is set only after that stage (a Running pod), and set
again if anything changes it back, so what the API says is where the engine listens.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kubernetes import client, watch
from urllib3.exceptions import HTTPError

from kvtune.harness.engine_process import start_engine
from kvtune.harness.local_http import health_ok
from kvtune.harness.server import ServerProcess
from tests.e2e.cluster import Cluster
from tests.e2e.pod_network import ADDRESSES, PodNetwork

# The pod addresses no e2e module claims by number (2-4 the package's engines, 5-6 test_rbac, 7 the README's
# Prometheus, 8 the example policy's engine, 9-10 the monitoring layouts'): the ones handed to watched pods.
UNCLAIMED_INDEXES = tuple(range(11, ADDRESSES + 2))
WATCH_S = 30  # a watch request's own length; the loop watches again from where it was
WATCH_CUTS = 3  # streams cut short in a row (the connection, not the server's timeout) before the watch fails
BOOTS_AT_ONCE = 3  # engines booting side by side on a small machine (each slower with every other)
BOOT_S = 240.0  # one engine's boot, while others boot beside it: a hang deadline
STOP_S = 30.0  # an engine's grace after SIGTERM


@dataclass
class Slot:
    """One pod's claim on an address, and its engine once booted."""

    address: str
    engine: ServerProcess | None = None  # None while it boots
    wanted: bool = True  # False once its pod has gone: the engine stops (at the end of its boot, if booting)


class PodEngines:
    """A context manager: inside it, every Running pod of `selector` in `namespace` has an engine at its
    `status.podIP` on `port` (all pods on one port, as a Service expects), booted with `engine_flags`.

    Use `wait_for_engines(count)` after a change of replicas, and `engines()` for what runs now. A boot that
    fails, a pod that finds every address taken, and a watch that breaks are raised there and on exit."""

    def __init__(
        self, cluster: Cluster, network: PodNetwork, namespace: str, selector: str, model_dir: Path,
        token_file: Path, folder: Path, port: int = 8000, engine_flags: Sequence[str] = (),
        indexes: Sequence[int] = UNCLAIMED_INDEXES, boots_at_once: int = BOOTS_AT_ONCE,
    ) -> None:  # fmt: skip
        self.core = client.CoreV1Api(cluster.api)
        self.network, self.namespace, self.selector = network, namespace, selector
        self.model_dir, self.token_file, self.folder = model_dir, token_file, folder
        self.port, self.engine_flags = port, tuple(engine_flags)
        self.addresses = [network.address(index) for index in indexes]
        self.free = list(self.addresses)  # handed out from the front, so pods take the lowest free one
        self.pods: dict[str, dict[str, Any]] = {}  # name -> the pod as last seen, for pods that exist
        self.slots: dict[str, Slot] = {}  # name -> its address and engine, from its boot to its engine's stop
        self.errors: list[BaseException] = []
        # pods refused an engine (its boot failed, or no address was left): the failure stands, no retry loops
        self.refused: set[str] = set()
        self.lock = threading.Condition()  # guards everything above; notified at every change
        self.boots = threading.BoundedSemaphore(boots_at_once)
        self.workers: list[threading.Thread] = []
        self.stopping = threading.Event()
        self.watcher: Any = watch.Watch()  # type: ignore[no-untyped-call]
        self.watch_thread = threading.Thread(target=self.watch_pods, name=f"pods of {selector}", daemon=True)

    # the caller's side

    def __enter__(self) -> Self:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.watch_thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        """The watch ends, boots finish (each engine then stops), and every engine stops; failures seen
        inside the block are raised, or noted on the exception that ends it."""
        self.stopping.set()
        deadline = time.monotonic() + WATCH_S + 10
        while self.watch_thread.is_alive() and time.monotonic() < deadline:
            self.watcher.stop()  # again: a stop just before a watch request begins is forgotten by it
            self.watch_thread.join(0.5)
        for worker in list(self.workers):
            worker.join(BOOT_S + STOP_S)
        with self.lock:
            running = [slot.engine for slot in self.slots.values() if slot.engine is not None]
            self.slots.clear()
        for engine in running:
            engine.stop(STOP_S)
        if self.watch_thread.is_alive():
            self.errors.append(RuntimeError(f"the watch on pods {self.selector} did not end"))
        if self.errors and error is not None:
            error.add_note(f"PodEngines also failed: {self.errors!r}")
        elif self.errors:
            self.raise_errors()

    def engines(self) -> dict[str, ServerProcess]:
        """Pod name -> its engine, for the engines that have booted and whose pods still exist."""
        with self.lock:
            return {name: slot.engine for name, slot in self.slots.items() if slot.engine and slot.wanted}

    def wait_for_engines(self, count: int, timeout: float = BOOT_S) -> dict[str, ServerProcess]:
        """Until exactly `count` engines answer /health, each at its pod's status.podIP as the API shows it,
        and no other engine boots or stops; then `engines()`. A failure inside is raised at once."""
        if count > len(self.addresses):
            raise ValueError(f"{count} engines asked for, but only {len(self.addresses)} pod addresses are "
                             f"handed out ({', '.join(self.addresses)})")  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            self.raise_errors()
            settled = self.settled(count)
            if settled is not None and all(health_ok(engine.url) for engine in settled.values()):
                return settled
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} pod engines: not within {timeout:.0f} s ({self.describe()})")
            with self.lock:
                self.lock.wait(0.25)

    def settled(self, count: int) -> dict[str, ServerProcess] | None:
        with self.lock:
            if len(self.slots) != count:
                return None
            for name, slot in self.slots.items():
                ip = (self.pods.get(name) or {}).get("status", {}).get("podIP")
                if slot.engine is None or not slot.wanted or ip != slot.address:
                    return None
            return {name: slot.engine for name, slot in self.slots.items() if slot.engine is not None}

    def describe(self) -> str:
        with self.lock:
            pods = {name: (pod.get("status", {}).get("phase"), pod.get("status", {}).get("podIP"))
                    for name, pod in self.pods.items()}  # fmt: skip
            slots = {name: (slot.address, "up" if slot.engine else "booting", "wanted" if slot.wanted else "going")
                     for name, slot in self.slots.items()}  # fmt: skip
        return f"pods (phase, podIP): {pods}; engines: {slots}"

    def raise_errors(self) -> None:
        with self.lock:
            errors = list(self.errors)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise BaseExceptionGroup(f"{len(errors)} failures of the engines of pods {self.selector}", errors)

    # the watch

    def watch_pods(self) -> None:
        """List, then watch from the list's resourceVersion. A watch the server let expire (410 Gone) lists
        again, so no pod's coming or going is missed; a stream cut short watches again from its last event,
        unless that keeps happening."""
        version: str | None = None
        cuts = 0  # streams cut in a row, without an event between them
        try:
            while not self.stopping.is_set():
                if version is None:
                    version = self.relist()
                try:  # events deserialized: with deserialize=False the client fails on an ERROR event (410's)
                    for event in self.watcher.stream(
                        self.core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                        resource_version=version, allow_watch_bookmarks=True, timeout_seconds=WATCH_S,
                    ):  # fmt: skip
                        pod, cuts = event["raw_object"], 0
                        version = pod["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self.observe(pod["metadata"]["name"], None if event["type"] == "DELETED" else pod)
                except client.ApiException as expired:
                    if expired.status != 410:
                        raise
                    version = None
                except (HTTPError, OSError):
                    cuts += 1
                    if cuts > WATCH_CUTS or self.stopping.is_set():
                        raise
        except BaseException as err:
            if not self.stopping.is_set():  # a stopped watch's socket is shut under it: its error is the stop
                self.fail(
                    RuntimeError(f"the watch on pods {self.selector} in {self.namespace} broke: {err!r}")
                )

    def relist(self) -> str:
        answer: Any = self.core.list_namespaced_pod(
            self.namespace, label_selector=self.selector, _preload_content=False
        )
        listed = json.loads(answer.data)
        found = {pod["metadata"]["name"]: pod for pod in listed["items"]}
        for name in set(self.pods) - set(found):
            self.observe(name, None)
        for name, pod in found.items():
            self.observe(name, pod)
        version: str = listed["metadata"]["resourceVersion"]
        return version

    def observe(self, name: str, pod: dict[str, Any] | None) -> None:
        """The pod as it is now (None: gone): an engine booted for a Running pod that has none, its IP set
        again where it differs from its engine's, an engine stopped for a pod that is going."""
        with self.lock:
            if pod is None:
                self.pods.pop(name, None)
            else:
                self.pods[name] = pod
            self.lock.notify_all()
        self.reconcile(name)

    def reconcile(self, name: str) -> None:
        with self.lock:
            pod = self.pods.get(name)
            live = pod is not None and self.runs(pod)
            slot = self.slots.get(name)
            if live and slot is None and name not in self.refused:
                self.claim(name)
            elif not live and slot is not None and slot.wanted:
                slot.wanted = False
                if slot.engine is not None:
                    self.work(f"stop {name}", self.retire, name, slot)
                self.lock.notify_all()
            repatch = live and slot is not None and slot.engine is not None and self.ip(name) != slot.address
        if repatch and slot is not None:
            self.set_ip(name, slot.address)

    @staticmethod
    def runs(pod: dict[str, Any]) -> bool:
        """Running under kwok and not going: kwok has set its IP, so ours is not overwritten."""
        going = pod["metadata"].get("deletionTimestamp")
        return pod.get("status", {}).get("phase") == "Running" and not going

    def ip(self, name: str) -> str | None:
        ip: str | None = (self.pods.get(name) or {}).get("status", {}).get("podIP")
        return ip

    def claim(self, name: str) -> None:
        """An address for the pod, and its engine's boot (the lock held). With none free and none about to
        be freed, the pod cannot have an engine: that fails, naming what holds them."""
        if not self.free:
            if all(slot.wanted for slot in self.slots.values()):
                self.refused.add(name)
                self.fail(RuntimeError(
                    f"pod {name}: all {len(self.addresses)} pod addresses are taken, by "
                    f"{ {n: s.address for n, s in self.slots.items()} } (PodEngines' indexes bound the pods)"))  # fmt: skip
            return  # an engine that is stopping frees one: its release claims again
        slot = Slot(self.free.pop(0))
        self.slots[name] = slot
        self.work(f"boot {name}", self.boot, name, slot)
        self.lock.notify_all()

    # the workers

    def work(self, what: str, task: Any, *args: Any) -> None:
        """`task(*args)` on a thread of its own, so the watch never waits for an engine."""
        worker = threading.Thread(target=task, args=args, name=what, daemon=True)
        self.workers = [w for w in self.workers if w.is_alive()] + [worker]
        worker.start()

    def boot(self, name: str, slot: Slot) -> None:
        try:
            with self.boots:
                if not slot.wanted or self.stopping.is_set():
                    self.release(name, slot)
                    return
                engine = self.network.run(start_engine, self.model_dir, self.token_file,
                                          self.folder / f"{name}.log", *self.engine_flags, port=self.port,
                                          host=slot.address, boot_timeout=BOOT_S)  # fmt: skip
        except BaseException as err:
            with self.lock:
                self.refused.add(name)
            self.release(name, slot)
            if slot.wanted:
                self.fail(RuntimeError(f"the engine of pod {name} at {slot.address}:{self.port} did not start "
                                       f"(log: {self.folder / f'{name}.log'}): {err}"))  # fmt: skip
            return
        with self.lock:
            slot.engine = engine
            keep = slot.wanted and not self.stopping.is_set()
            self.lock.notify_all()
        if keep:
            self.set_ip(name, slot.address)
        else:
            self.retire(name, slot)

    def retire(self, name: str, slot: Slot) -> None:
        try:
            if slot.engine is not None:
                slot.engine.stop(STOP_S)
        finally:
            self.release(name, slot)

    def release(self, name: str, slot: Slot) -> None:
        """The pod's address back in the pool (its engine has exited), and any pod that waited for one."""
        with self.lock:
            if self.slots.get(name) is slot:
                del self.slots[name]
            self.free.append(slot.address)
            self.free.sort(key=self.addresses.index)
            waiting = [n for n, pod in self.pods.items() if n not in self.slots and self.runs(pod)]
            self.lock.notify_all()
        if not self.stopping.is_set():
            for other in waiting:
                self.reconcile(other)

    def set_ip(self, name: str, address: str) -> None:
        """status.podIP and podIPs, as a merge patch: a strategic merge would add to kwok's podIPs (merged by
        `ip`) rather than replace them. A pod deleted meanwhile is no failure."""
        body = {"status": {"podIP": address, "podIPs": [{"ip": address}]}}
        try:
            self.core.patch_namespaced_pod_status(name, self.namespace, body,
                                                  _content_type="application/merge-patch+json")  # fmt: skip
        except client.ApiException as err:
            if err.status != 404:
                self.fail(RuntimeError(f"could not set pod {name}'s IP to {address}: {err}"))

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.errors.append(error)
            self.lock.notify_all()
