"""`kvtune doctor --pod NAMESPACE/NAME`: the doctor reads vLLM's flags from the pod's spec through the
official Kubernetes client and a kubeconfig (here an API server stub on loopback), so the what-if table
needs no --max-num-seqs; a pod it cannot read is one line and exit code 2."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvtune.cli import main
from kvtune.errors import KvtuneError
from kvtune.operator.doctor.pod_spec import split_pod_ref
from tests.operator.helpers import reply
from tests.operator.recorded_metrics import RECORDED

POD = {
    "kind": "Pod",
    "apiVersion": "v1",
    "metadata": {"name": "llama-0", "namespace": "inference"},
    "spec": {
        "containers": [
            {"name": "proxy", "image": "kvtune/proxy:0.1.0", "args": ["proxy"]},
            {
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.32.0",
                "args": ["--model", "m", "--max-num-seqs", "64"],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            },
        ]
    },
}


class PodHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.seen.append(self.path)  # type: ignore[attr-defined]
        if self.path.startswith("/api/v1/namespaces/inference/pods/llama-0"):
            reply(self, 200, "application/json", json.dumps(POD).encode())
        else:
            body = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "NotFound",
                "code": 404,
            }
            reply(self, 404, "application/json", json.dumps(body).encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), PodHandler)
    httpd.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    config = tmp_path / "kubeconfig"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{httpd.server_port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "inference"}}
                ],
                "current-context": "x",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_the_pods_flags_feed_the_what_if_table(
    kubeconfig: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--metrics-file", str(RECORDED), "--pod", "llama-0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    config = report["engine_config"]
    assert config["max_num_seqs"] == 64
    assert config["max_num_seqs_from"] == "--max-num-seqs in pod inference/llama-0 container vllm"
    assert (config["device"], config["vllm_version"]) == ("cuda", "v0.32.0")
    assert report["what_if"]["round_to"] == 8 and report["what_if"]["recommended"] % 8 == 0
    assert report["admission_flag"]["flag"] == "--max-num-active-seqs"
    assert "from the pod's image tag" in report["admission_flag"]["why"]
    assert kubeconfig.seen[0].startswith("/api/v1/namespaces/inference/pods/llama-0")  # type: ignore[attr-defined]


def test_a_pod_that_is_not_there_is_one_line(
    kubeconfig: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--metrics-file", str(RECORDED), "--pod", "inference/gone"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "kvtune: error: --pod inference/gone: HTTP 404 Not Found"


def test_pod_refs() -> None:
    assert split_pod_ref("ns/p") == ("ns", "p")
    assert split_pod_ref("p") == (None, "p")
    for bad in ("ns/", "/p", "a/b/c", ""):
        with pytest.raises(KvtuneError, match="expected NAMESPACE/NAME or NAME"):
            split_pod_ref(bad)
