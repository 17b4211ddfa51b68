"""The pods' network of an e2e run: a network namespace the run makes itself (`ip netns add`), joined to this
machine by a veth pair. The host end holds the first address of a /24 of the control plane's pod CIDR, the
namespace end the pods' addresses; everything that stands in for a pod (the engines, the recorded pod
engines, the Prometheus that scrapes them) listens inside it, and the operator, on the host, reaches them
through the veth as it would reach pods. Nothing is routed anywhere else, and all of it is removed after the
run, failed or not (a run killed before that is cleaned up by the next one: its namespace names its pid).

The API server refuses loopback addresses in an EndpointSlice (a pod is never at 127.x), hence real
pod-network addresses; a namespace of our own, hence no traffic to a private address outside the run.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

PREFIX = "kvtune-e2e-"
POD_CIDR = ipaddress.IPv4Network("10.244.0.0/16")  # local_cluster.py's pod CIDR
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
ADDRESSES = 14  # pods' addresses in the namespace: .2 to .15
T = TypeVar("T")


def ip_command() -> str:
    found = shutil.which("ip")
    if found is None:
        pytest.fail("`ip` (iproute2) is not on PATH: the e2e run puts its pods in a network namespace with it "
                    "(apt-get install iproute2)", pytrace=False)  # fmt: skip
    return found


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([ip_command(), *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def namespaces() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()}


def links() -> set[str]:
    return {entry["ifname"] for entry in json.loads(ip("-j", "link", "show").stdout or "[]")}


def routed_subnets() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every destination this machine already routes, in any table (another run's pods among them)."""
    found = []
    for entry in json.loads(ip("-j", "route", "show", "table", "all").stdout or "[]"):
        destination = entry.get("dst", "")
        if destination and destination != "default" and not destination.startswith(("ff", "fe80")):
            try:
                found.append(ipaddress.ip_network(destination, strict=False))
            except ValueError:
                continue
    return found


def free_subnet() -> ipaddress.IPv4Network:
    """The highest /24 of the pod CIDR that nothing on this machine routes yet."""
    taken = [other for other in routed_subnets() if isinstance(other, ipaddress.IPv4Network)]
    for subnet in reversed(list(POD_CIDR.subnets(new_prefix=24))):
        if not any(subnet.overlaps(other) for other in taken):
            return subnet
    raise RuntimeError(f"every /24 of {POD_CIDR} is routed on this machine already")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """The namespaces of earlier runs that were killed before their cleanup (their pid is gone)."""
    for name in namespaces():
        if name.startswith(PREFIX) and name[len(PREFIX) :].isdigit() and not alive(int(name[len(PREFIX) :])):
            remove(name, f"kve{name[len(PREFIX) :]}h")


def remove(name: str, host_link: str) -> None:
    """The veth pair (both ends go with either) and the namespace; processes still inside are this run's
    (they were started in its namespace) and are stopped first, by pid."""
    if name in namespaces():
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    if host_link in links():
        ip("link", "del", host_link, check=False)
    if name in namespaces():
        ip("netns", "del", name, check=False)


@dataclass(frozen=True)
class PodNetwork:
    name: str  # the network namespace
    host_link: str  # the veth end on this machine
    subnet: ipaddress.IPv4Network

    @property
    def host_address(self) -> str:
        return str(self.subnet.network_address + 1)

    def address(self, index: int) -> str:
        """A pod's address: index 2 and up (1 is the host's end)."""
        assert 2 <= index < ADDRESSES + 2, index
        return str(self.subnet.network_address + index)

    def run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`work` called in a thread of its own inside the namespace, and its result: what it binds listens
        in there, and what it starts (subprocess.Popen) runs in there, as under `ip netns exec`. The
        thread ends with the call, so nothing else of this process ever enters the namespace."""
        outcome: dict[str, Any] = {}

        def inside() -> None:
            try:
                enter(self.name)
                outcome["value"] = work(*args, **kwargs)
            except BaseException as err:  # handed to the caller
                outcome["error"] = err

        thread = threading.Thread(target=inside, name=f"in {self.name}")
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        value: T = outcome["value"]
        return value


def enter(name: str) -> None:
    """setns(2) of the calling thread into network namespace `name` (what `ip netns exec` does)."""
    libc = ctypes.CDLL(None, use_errno=True)
    descriptor = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(descriptor, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {name}: {os.strerror(error)}")
    finally:
        os.close(descriptor)


@contextmanager
def pod_network() -> Iterator[PodNetwork]:
    """A network namespace with a veth pair to this machine, up for the block and gone after it."""
    remove_stale()
    pid = os.getpid()
    network = PodNetwork(f"{PREFIX}{pid}", f"kve{pid}h", free_subnet())
    inner = f"kve{pid}p"
    try:
        ip("netns", "add", network.name)
        ip("link", "add", network.host_link, "type", "veth", "peer", "name", inner, "netns", network.name)
        ip("addr", "add", f"{network.host_address}/{network.subnet.prefixlen}", "dev", network.host_link)
        ip("link", "set", network.host_link, "up")
        ip("-n", network.name, "link", "set", "lo", "up")
        ip("-n", network.name, "link", "set", inner, "up")
        for index in range(2, ADDRESSES + 2):  # the pods' addresses, in the same /24, on the namespace's end
            ip("-n", network.name, "addr", "add", f"{network.address(index)}/{network.subnet.prefixlen}",
               "dev", inner)  # fmt: skip
    except RuntimeError as err:
        remove(network.name, network.host_link)
        pytest.fail(f"could not make the pods' network namespace ({err}): the e2e run needs root with "
                    "CAP_NET_ADMIN and CAP_SYS_ADMIN (`ip netns add`, a veth pair)", pytrace=False)  # fmt: skip
    try:
        yield network
    finally:
        remove(network.name, network.host_link)
