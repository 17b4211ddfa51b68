"""scripts/local_cluster.py itself: the build recipe's pure parts (the staging replaces and godebug read from
k8s.io/kubernetes' go.mod, which binaries a cache lacks, the monitoring stack's too), the config reloader's
rewrite of prometheus-operator's configuration, what `up`, `down` and `token` refuse, and that `restart` starts
a component again from its recorded command line (the fault tests kill etcd and the API server with it). That
`up` starts a working control plane and `down` leaves no process and no open port is what every other
e2e test stands on (the `cluster` fixture checks the latter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, local_cluster

GO_MOD = """module k8s.io/kubernetes

go 1.26.0

godebug default=go1.26

require (
\tgithub.com/blang/semver/v4 v4.0.0
\tk8s.io/api v0.0.0
\tk8s.io/apimachinery v0.0.0
\tk8s.io/klog/v2 v2.130.1
)

require k8s.io/cri-streaming v0.0.0 // indirect

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
)
"""


def test_every_staging_module_is_replaced_by_its_published_tag() -> None:
    lc = local_cluster()
    assert lc.staging_replaces(GO_MOD, "v0.36.3") == [
        "-replace=k8s.io/api=k8s.io/api@v0.36.3",
        "-replace=k8s.io/apimachinery=k8s.io/apimachinery@v0.36.3",
        "-replace=k8s.io/cri-streaming=k8s.io/cri-streaming@v0.36.3",
    ]
    assert lc.godebug_lines(GO_MOD) == ["default=go1.26"]
    with pytest.raises(lc.ClusterError, match="no staging modules"):
        lc.staging_replaces("module x\n\nrequire k8s.io/klog/v2 v2.130.1\n", "v0.36.3")


def test_a_cache_built_from_other_pins_is_rebuilt_whole(tmp_path: Path) -> None:
    lc = local_cluster()
    assert lc.missing_binaries(tmp_path) == [*lc.BINARIES, lc.STAGES_FILE]
    for name in lc.BINARIES:
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(0o755)
    (tmp_path / lc.STAMP).write_text(json.dumps(lc.pins()))
    assert lc.missing_binaries(tmp_path) == [lc.STAGES_FILE]
    (tmp_path / lc.STAGES_FILE).write_text("")
    assert lc.missing_binaries(tmp_path) == []
    (tmp_path / lc.STAMP).write_text(json.dumps({**lc.pins(), "kubernetes": "1.35.4"}))
    assert lc.missing_binaries(tmp_path) == [*lc.BINARIES, lc.STAGES_FILE]


def test_up_down_and_token_refuse_what_they_cannot_do(cluster: Cluster, tmp_path: Path) -> None:
    lc = local_cluster()
    with pytest.raises(lc.ClusterError, match="already running"):
        lc.up(cluster.folder)
    with pytest.raises(lc.ClusterError, match="no control plane was started"):
        lc.down(tmp_path)
    with pytest.raises(lc.ClusterError, match="no token for ServiceAccount default/nobody: HTTP 404"):
        lc.service_account_kubeconfig(cluster.folder, "default", "nobody")
    assert lc.main(["up"]) == 2 and lc.main(["token", str(tmp_path), "no-slash"]) == 2


def test_the_reloader_points_the_operators_config_at_this_machine(tmp_path: Path) -> None:
    """What a Prometheus pod would find under /etc/prometheus is read under the folder, and Kubernetes
    discovery reaches the control plane through the kubeconfig (a pod would use its ServiceAccount)."""
    monitoring = local_cluster().monitoring_stack()
    config = {
        "rule_files": ["/etc/prometheus/rules/prometheus-x-rulefiles-0/*.yaml"],
        "scrape_configs": [{
            "job_name": "podMonitor/ns/m/0",
            "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": ["llm"]},
                                       "api_server": "https://in-cluster", "tls_config": {"ca_file": "/x"}}],
            "tls_config": {"ca_file": "/etc/prometheus/certs/secret_ns_ca_ca.crt"},
            "relabel_configs": [{"regex": "/etc/prometheus-like, not a path", "action": "keep"}],
        }],
    }  # fmt: skip
    kubeconfig = tmp_path / "kubeconfig"
    (job,) = monitoring.localised(config, tmp_path / "etc", kubeconfig)["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [
        {"role": "pod", "namespaces": {"names": ["llm"]}, "kubeconfig_file": str(kubeconfig)}
    ]
    assert job["tls_config"]["ca_file"] == str(tmp_path / "etc" / "certs" / "secret_ns_ca_ca.crt")
    assert job["relabel_configs"] == config["scrape_configs"][0]["relabel_configs"]  # type: ignore[index]
    rules = monitoring.localised(config, tmp_path / "etc", kubeconfig)["rule_files"]
    assert rules == [str(tmp_path / "etc" / "rules" / "prometheus-x-rulefiles-0" / "*.yaml")]


def test_a_monitoring_cache_built_from_other_pins_is_rebuilt_whole(tmp_path: Path) -> None:
    monitoring = local_cluster().monitoring_stack()
    assert monitoring.missing(tmp_path) == [*monitoring.BINARIES, monitoring.CRD_FOLDER]
    (tmp_path / monitoring.STAMP).write_text(json.dumps(monitoring.pins()))
    for name in monitoring.BINARIES[:2]:
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(0o755)
    assert monitoring.missing(tmp_path) == [monitoring.BINARIES[2], monitoring.CRD_FOLDER]
    (tmp_path / monitoring.STAMP).write_text(json.dumps({**monitoring.pins(), "prometheus": "v0.315.0"}))
    assert monitoring.missing(tmp_path) == [*monitoring.BINARIES, monitoring.CRD_FOLDER]


def test_restart_starts_a_component_again_with_its_own_command_line(tmp_path: Path) -> None:
    """`restart` (what the fault tests kill and start again) reruns a component from the command line the state
    file recorded, records the new pid, and leaves the other components alone; `down` then stops the new one."""
    lc = local_cluster()
    logs = tmp_path / "logs"
    logs.mkdir()
    processes = {"sleep": lc.start("sleep", ["sleep", "300"], logs)}
    processes["tail"] = lc.start("tail", ["tail", "-f", "/dev/null"], logs)
    lc.write_state(tmp_path, "https://127.0.0.1:1", processes)
    try:
        first = processes["sleep"].pid
        second = lc.restart(tmp_path, "sleep", kill=True)
        state = json.loads((tmp_path / lc.STATE_FILE).read_text())
        assert second != first and not lc.alive(first, "sleep") and lc.alive(second, "sleep")
        assert state["pids"] == {"sleep": second, "tail": processes["tail"].pid}
        assert state["launches"]["sleep"]["argv"] == ["sleep", "300"]
        assert Path(f"/proc/{second}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"300"]
        with pytest.raises(lc.ClusterError, match="still running"):
            lc.start_component(tmp_path, "sleep")
        with pytest.raises(lc.ClusterError, match="etcd was not started by `up`"):
            lc.restart(tmp_path, "etcd")
    finally:
        lc.down(tmp_path)
    assert not lc.alive(second, "sleep") and not lc.alive(processes["tail"].pid, "tail")
