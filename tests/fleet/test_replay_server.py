"""The replay server as a process: one process answers many endpoints (addresses and ports), each with its
own recording, keep-alive, and 404 for anything but /metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from kvtune.bench.fleet_replay import replay_of
from kvtune.harness.local_http import free_port

REPO = Path(__file__).resolve().parents[2]
VLLM_RECORDING = REPO / "docs" / "examples" / "vllm-0.32-cpu-preempting.prom"


def test_one_process_serves_each_endpoint_its_own_recording(tmp_path: Path) -> None:
    other = tmp_path / "other.prom"
    other.write_text("# scraped_at 10\n# TYPE other_total counter\nother_total 5.0\n"
                     "# scraped_at 12\n# TYPE other_total counter\nother_total 7.0\n")  # fmt: skip
    shared, alone = free_port(), free_port()
    endpoints = [("127.0.0.1", shared, "vllm"), ("127.0.0.2", shared, "other"), ("127.0.0.1", alone, "other")]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({
        "recordings": {"vllm": {"path": str(VLLM_RECORDING), "version": "0.32.0"}, "other": str(other)},
        "endpoints": [{"address": a, "port": p, "recording": r} for a, p, r in endpoints],
    }))  # fmt: skip
    server = subprocess.Popen([sys.executable, "-m", "kvtune.bench.fleet_replay_server", str(plan)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)  # fmt: skip
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "serving 3 endpoints"
        vllm = {replay_of("v", VLLM_RECORDING.read_text()).render(0, i) for i in range(6)}
        with httpx.Client(timeout=10) as http:
            first = http.get(f"http://127.0.0.1:{shared}/metrics")
            again = http.get(f"http://127.0.0.1:{shared}/metrics")  # the same connection, kept alive
            assert first.status_code == again.status_code == 200
            assert first.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert first.content in vllm and again.content in vllm
            for address, port in (("127.0.0.2", shared), ("127.0.0.1", alone)):
                answer = http.get(f"http://{address}:{port}/metrics")
                assert answer.status_code == 200 and answer.text.startswith("# TYPE other_total counter\n")
            assert http.get(f"http://127.0.0.1:{shared}/version").json() == {"version": "0.32.0"}
            assert http.get(f"http://127.0.0.1:{alone}/version").status_code == 404  # no version recorded
            assert http.get(f"http://127.0.0.1:{alone}/health").status_code == 404
    finally:
        server.terminate()
        assert server.wait(30) == 0
