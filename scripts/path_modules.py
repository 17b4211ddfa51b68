"""Count the kvtune modules one completion or one operator tick runs code in (ARCHITECTURE.md's paths).

A module counts when a Python function of it is called on the path, in any thread; boot, and the code a
dataclass generates, do not. Counted by the profiler rather than by reading, so a count at an older commit
is one command there (run from that checkout):

  python scripts/path_modules.py completion   # one non-streamed completion on `kvtune serve`, after a warm-up
  python scripts/path_modules.py tick         # each evaluation of tests/operator/k8s/test_pods_kmock.py's
                                              # three-pod vLLM Deployment: a read, the one patch, the rollout
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def module_of(frame: FrameType) -> str | None:
    """`engine/loop/output.py` for a frame of kvtune's own code; None for anything else (tests included)."""
    name = frame.f_code.co_filename
    if "/kvtune/" not in name or "/tests/" in name:
        return None
    return name.split("/kvtune/", 1)[1]


def completion() -> list[set[str]]:
    import httpx
    import torch

    from kvtune.engine.model.tiny_model import write_tiny_model
    from tests.server.live_server import start_server

    seen: set[str] = set()
    counting = threading.Event()

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if counting.is_set() and event == "call" and (module := module_of(frame)) is not None:
            seen.add(module)

    sys.setprofile(profile)
    threading.setprofile(profile)
    torch.set_num_threads(1)
    started = start_server(write_tiny_model(Path(tempfile.mkdtemp())), "--kv-cache-tokens", "1024")
    # older checkouts return the server itself, newer ones a context manager
    stop = getattr(started, "stop", None)
    with started if stop is None else contextlib.nullcontext(started) as live:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "hello there, how are", "max_tokens": 8, "temperature": 0}
            for _ in range(2):  # warm-up: lazy imports and first-call caches are boot, not the path
                http.post("/v1/completions", json=body).raise_for_status()
            counting.set()
            http.post("/v1/completions", json=body).raise_for_status()
            counting.clear()
        if stop is not None:
            stop()
    return [seen]


def tick() -> list[set[str]]:
    import pytest

    ticks: list[set[str]] = []
    current: dict[str, FrameType | None] = {"frame": None}

    def profile(frame: FrameType, event: str, _: Any) -> None:
        code = frame.f_code
        if event == "call" and current["frame"] is None and code.co_name == "run_once":
            if code.co_filename.endswith("kvtune/operator/k8s/reconcile.py"):
                current["frame"] = frame
                ticks.append(set())
        elif event == "return" and frame is current["frame"]:
            current["frame"] = None
        if event == "call" and current["frame"] is not None and (module := module_of(frame)) is not None:
            ticks[-1].add(module)

    class Profiled:
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_setup(self) -> None:
            sys.setprofile(profile)
            threading.setprofile(profile)

        def pytest_runtest_teardown(self) -> None:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]

    test = next(REPO.glob("tests/operator/**/test_pods_kmock.py"))
    args = ["-q", "-p", "no:cacheprovider", str(test), "-k", "exactly_one_patch"]
    if pytest.main(args, plugins=[Profiled()]) != 0:
        raise SystemExit("the traced test failed: no count")
    return ticks


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("completion", "tick"):
        raise SystemExit(__doc__)
    for number, modules in enumerate(completion() if sys.argv[1] == "completion" else tick(), 1):
        print(f"{sys.argv[1]} {number}: {len(modules)} modules")
        for module in sorted(modules):
            print(f"  {module}")
