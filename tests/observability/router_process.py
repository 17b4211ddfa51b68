"""PyPI's `vllm-router` (vllm-project/router, the Rust router) from its own venv, in front of engines on
loopback: the router a layout puts between clients and engines, with its own Prometheus endpoint.

scripts/install_vllm_router.py installs it (`make router-tools`, which `make test` runs); without it a test
FAILS with that command, never skips.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from kvtune.harness.local_http import free_port
from tests.observability.live_stack import Process
from tests.repo_scripts import load_script


def installer() -> ModuleType:
    return load_script("install_vllm_router")


def router_python() -> Path:
    """The router venv's interpreter, or a test failure that says how to install it."""
    install = installer()
    if not install.is_installed(install.DEFAULT_VENV):
        pytest.fail(
            f"{install.REQUIREMENT} is not installed in {install.DEFAULT_VENV}: run `make router-tools` "
            f"({sys.executable} scripts/install_vllm_router.py), which `make test` does",
            pytrace=False,
        )
    python: Path = install.python_of(install.DEFAULT_VENV)
    return python


@dataclass(frozen=True)
class Router:
    url: str  # where clients send requests
    metrics_address: str  # host:port of its Prometheus endpoint (/metrics)
    own_series: str  # a matcher only the router's own series meet (the Rust router's names; production-stack's `server`)


# A Python that imports production-stack's own router (`vllm_router.app`, from its repository: no registry
# these machines reach serves it). Set, the router tests run it in place of PyPI's Rust router.
PRODUCTION_STACK_ROUTER = "KVTUNE_PRODUCTION_STACK_ROUTER"


@contextmanager
def running_router(workers: Sequence[str], folder: Path) -> Iterator[Router]:
    """The router with round-robin over `workers` (base URLs), ready to route; stopped on exit."""
    port, metrics_port = free_port(), free_port()
    argv = [
        str(router_python()), "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *workers, "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
    ]  # fmt: skip
    own_series = '__name__=~"vllm_router_.+"'
    production_stack = os.environ.get(PRODUCTION_STACK_ROUTER)
    if production_stack:  # its /metrics is on its serving port; its vllm: gauges are per backend
        metrics_port, own_series = port, 'server!=""'
        argv = [
            production_stack, "-m", "vllm_router.app", "--host", "127.0.0.1", "--port", str(port),
            "--service-discovery", "static", "--static-backends", ",".join(workers),
            "--static-models", ",".join(["tiny"] * len(workers)), "--routing-logic", "roundrobin",
        ]  # fmt: skip
    process = Process("vllm-router", argv, folder / "router.log")
    try:
        process.wait_ready(f"http://127.0.0.1:{port}/health")
        yield Router(f"http://127.0.0.1:{port}", f"127.0.0.1:{metrics_port}", own_series)
    finally:
        process.stop()
