"""What the chart's values do: the hardening every container gets, the operator's arguments and peering,
the PDB past one replica, the dashboards' ConfigMaps, monitoring objects only with their CRDs, RBAC per
watched namespace or cluster-wide with Secrets by name only, the examples, and values.schema.json
refusing a wrong value with a message that names it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtune.dashboards.build import rendered as rendered_dashboards
from tests.chart.helm import MONITORING_API, NAMESPACE, OPERATOR_IMAGE, REPO, by_kind, one, render, template
from tests.chart.matrix import ENGINE_IMAGE, ENGINE_ON, POD_MONITOR_ON, PROXY_IMAGE, VLLM_PROXY_ON


def containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload name, pod spec, container) for every container the chart runs."""
    return [
        (workload["metadata"]["name"], workload["spec"]["template"]["spec"], container)
        for workload in by_kind(objects, "Deployment")
        for container in workload["spec"]["template"]["spec"]["containers"]
    ]


def operator_args(objects: list[dict[str, Any]]) -> list[str]:
    (deployment,) = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == "kvtune"]
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def rules_by_resource(role: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        f"{group}/{resource}": rule
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def test_every_container_is_hardened(tmp_path: Path) -> None:
    objects = render(
        {**ENGINE_ON, "examples": {**ENGINE_ON["examples"], **VLLM_PROXY_ON["examples"]}}, tmp_path
    )
    found = containers(objects)
    assert {container["name"] for _, _, container in found} == {"operator", "engine", "vllm", "kvtune-proxy"}
    for workload, pod, container in found:
        where = f"{workload}/{container['name']}"
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] == 65532, where
        security = container["securityContext"]
        assert security["runAsNonRoot"] is True, where
        assert security["readOnlyRootFilesystem"] is True, where
        assert security["allowPrivilegeEscalation"] is False, where
        assert security["capabilities"] == {"drop": ["ALL"]}, where
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert container["resources"]["requests"] and container["resources"]["limits"], where
        writable = {mount["mountPath"] for mount in container["volumeMounts"] if not mount.get("readOnly")}
        assert "/tmp" in writable, where


def test_the_operator_runs_with_health_probes_metrics_and_peering(tmp_path: Path) -> None:
    objects = render({}, tmp_path)
    (operator,) = [c for _, _, c in containers(objects) if c["name"] == "operator"]
    assert operator["image"] == f"{OPERATOR_IMAGE}:0.1.0"
    assert operator["args"] == [
        "operator", "--metrics-port", "9100", "--liveness-port", "8080", "--peering", "kvtune",
        "--max-mode", "Recommend", "--workers", "16", "--kube-api-qps", "20", "--kube-api-burst", "30",
        "--namespace", NAMESPACE,
    ]  # fmt: skip
    ports = {port["name"]: port["containerPort"] for port in operator["ports"]}
    assert ports == {"metrics": 9100, "health": 8080}
    for probe in ("livenessProbe", "readinessProbe"):
        assert operator[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    peering = one(objects, "KopfPeering")
    assert (peering["metadata"]["name"], peering["metadata"]["namespace"]) == ("kvtune", NAMESPACE)
    assert by_kind(objects, "ClusterKopfPeering") == []


def test_one_replica_has_no_pdb_and_two_replicas_get_one(tmp_path: Path) -> None:
    assert by_kind(render({}, tmp_path), "PodDisruptionBudget") == []
    objects = render({"replicas": 2}, tmp_path)
    assert one(objects, "Deployment")["spec"]["replicas"] == 2
    budget = one(objects, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    assert (
        budget["spec"]["selector"]["matchLabels"]
        == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    )


def test_each_dashboard_is_a_labelled_config_map_holding_its_json(tmp_path: Path) -> None:
    maps = by_kind(render({}, tmp_path), "ConfigMap")
    expected = {name: json.loads(text) for name, text in rendered_dashboards().items()}
    held = {}
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "kvtune"}
        ((name, text),) = config_map["data"].items()
        held[name] = json.loads(text)
    assert held == expected
    assert by_kind(render({"dashboards": {"enabled": False}}, tmp_path), "ConfigMap") == []


@pytest.mark.parametrize(
    ("values", "api_versions", "expected"),
    [
        ({}, (), False),
        ({}, (MONITORING_API,), True),
        ({"monitoring": {"force": True}}, (), True),
        ({"monitoring": {"enabled": False}}, (MONITORING_API,), False),
    ],
    ids=["crds-absent", "crds-present", "forced", "disabled"],
)
def test_monitoring_objects_only_where_the_prometheus_operator_is(
    tmp_path: Path, values: dict[str, Any], api_versions: tuple[str, ...], expected: bool
) -> None:
    objects = render(values, tmp_path, api_versions)
    kinds = {obj["kind"] for obj in objects}
    assert ({"ServiceMonitor", "PrometheusRule"} <= kinds) is expected
    assert not ({"ServiceMonitor", "PrometheusRule"} & kinds) or expected
    assert "PodMonitor" not in kinds  # off until told which pods are the engines
    assert one(objects, "Service")["spec"]["ports"][0]["port"] == 9100  # the metrics Service is always there


def test_namespaced_rbac_is_one_role_per_watched_namespace(tmp_path: Path) -> None:
    objects = render(
        {"watchNamespaces": ["team-a", "team-b"], "adminTokenSecrets": ["llama-admin"]}, tmp_path
    )
    assert by_kind(objects, "ClusterRole") == [] and by_kind(objects, "ClusterRoleBinding") == []
    roles = {role["metadata"]["namespace"]: role for role in by_kind(objects, "Role")}
    bindings = {binding["metadata"]["namespace"]: binding for binding in by_kind(objects, "RoleBinding")}
    assert sorted(roles) == sorted(bindings) == ["team-a", "team-b"]
    for namespace, binding in bindings.items():
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvtune", "namespace": NAMESPACE}]
        assert binding["roleRef"]["name"] == roles[namespace]["metadata"]["name"]
    rules = rules_by_resource(roles["team-a"])
    assert sorted(rules) == [
        "/events", "/secrets", "apps/deployments", "apps/statefulsets", "autoscaling/horizontalpodautoscalers",
        "discovery.k8s.io/endpointslices", "keda.sh/scaledobjects", "kopf.dev/kopfpeerings",
        "kvtune.dev/kvtuningpolicies", "kvtune.dev/kvtuningpolicies/status",
    ]  # fmt: skip
    assert rules["/secrets"]["resourceNames"] == ["llama-admin"] and rules["/secrets"]["verbs"] == ["get"]
    assert rules["kvtune.dev/kvtuningpolicies/status"]["verbs"] == ["patch"]
    assert rules["/events"]["verbs"] == ["create"]
    args = operator_args(objects)
    assert args[args.index("--namespace") :] == ["--namespace", "team-a", "--namespace", "team-b"]
    assert sorted(p["metadata"]["namespace"] for p in by_kind(objects, "KopfPeering")) == ["team-a", "team-b"]


def test_without_admin_token_secrets_no_secret_is_readable(tmp_path: Path) -> None:
    """An empty resourceNames would grant every Secret: the rule is left out instead."""
    role = one(render({}, tmp_path), "Role")
    assert "/secrets" not in rules_by_resource(role)


def test_cluster_wide_is_one_cluster_role_and_a_cluster_peering(tmp_path: Path) -> None:
    objects = render({"clusterWide": True, "adminTokenSecrets": ["llama-admin"]}, tmp_path)
    assert by_kind(objects, "Role") == [] and by_kind(objects, "KopfPeering") == []
    rules = rules_by_resource(one(objects, "ClusterRole"))
    assert "kopf.dev/clusterkopfpeerings" in rules and "kopf.dev/kopfpeerings" not in rules
    assert "apiextensions.k8s.io/customresourcedefinitions" not in rules  # kopf scans no CRDs
    assert rules["/secrets"]["resourceNames"] == ["llama-admin"]
    binding = one(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvtune", "namespace": NAMESPACE}]
    assert one(objects, "ClusterKopfPeering")["metadata"]["name"] == "kvtune"
    args = operator_args(objects)
    assert "--all-namespaces" in args and "--namespace" not in args


def engine_selector(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [
        d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == "kvtune-example-engine"
    ]
    return dict(deployment["spec"]["selector"]["matchLabels"])


def test_the_example_engine_is_tuned_through_its_admin_api(tmp_path: Path) -> None:
    objects = render(ENGINE_ON, tmp_path)
    secret = one(objects, "Secret")
    policy = one(objects, "KVTuningPolicy")
    (engine,) = [c for _, _, c in containers(objects) if c["name"] == "engine"]
    assert engine["image"] == f"{ENGINE_IMAGE}:0.1.0"
    assert engine["args"][:2] == ["serve", "--tiny"]
    token_file = engine["args"][engine["args"].index("--admin-token-file") + 1]
    assert token_file == "/var/run/kvtune/admin/token"
    # every replica is read and tuned: the Service's pods from its EndpointSlices, at the engine's port
    engine_port = {port["name"]: port["containerPort"] for port in engine["ports"]}["http"]
    assert policy["spec"]["target"] == {
        "name": "kvtune-example-engine",
        "engine": "kvtune",
        "adminTokenSecretRef": {"name": secret["metadata"]["name"]},
        "podEndpoints": {"service": "kvtune-example-engine", "metricsPort": engine_port},
    }
    assert "--admin-port" not in engine["args"]  # so the admin API is on metricsPort, the default adminPort
    assert "metrics" not in policy["spec"]
    service = next(s for s in by_kind(objects, "Service") if s["metadata"]["name"] == "kvtune-example-engine")
    assert service["spec"]["selector"] == engine_selector(objects)
    # The operator may read this Secret, and only because the example is on.
    assert rules_by_resource(one(objects, "Role"))["/secrets"]["resourceNames"] == [
        secret["metadata"]["name"]
    ]


def test_the_vllm_example_sends_clients_through_the_proxy_sidecar(tmp_path: Path) -> None:
    objects = render(VLLM_PROXY_ON, tmp_path)
    (deployment,) = [
        d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == "kvtune-example-vllm"
    ]
    vllm, proxy = deployment["spec"]["template"]["spec"]["containers"]
    assert (vllm["name"], proxy["name"]) == ("vllm", "kvtune-proxy")
    assert proxy["args"][:3] == ["proxy", "--upstream", "http://127.0.0.1:8000"]
    assert (vllm["image"], proxy["image"]) == ("vllm/vllm-openai:v0.11.0", f"{PROXY_IMAGE}:0.1.0")
    assert (
        proxy["args"][proxy["args"].index("--model-dir") + 1]
        == vllm["args"][vllm["args"].index("--model") + 1]
    )
    services = {service["metadata"]["name"]: service for service in by_kind(objects, "Service")}
    client_port = services["kvtune-example-vllm"]["spec"]["ports"][0]
    assert (client_port["name"], client_port["port"], client_port["targetPort"]) == ("http", 8000, "proxy")
    proxy_ports = {port["name"]: port["containerPort"] for port in proxy["ports"]}
    assert proxy_ports["proxy"] == 8001
    assert [port["name"] for port in services["kvtune-example-vllm"]["spec"]["ports"]] == ["http"]
    policy = one(objects, "KVTuningPolicy")["spec"]
    assert policy["target"]["engine"] == "vllm" and policy["target"]["container"] == "vllm"
    # every pod is read and capped at its containers' ports: vLLM's /metrics, the proxy's and its admin API
    engine_service = services[policy["target"]["podEndpoints"]["service"]]
    assert engine_service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert policy["target"]["podEndpoints"] == {
        "service": "kvtune-example-vllm-engine",
        "metricsPort": {port["name"]: port["containerPort"] for port in vllm["ports"]}["http"],
        "proxyPort": proxy_ports["proxy"],
        "proxyAdminPort": proxy_ports["proxy-admin"],
    }
    assert proxy["args"][proxy["args"].index("--admin-port") + 1] == str(proxy_ports["proxy-admin"])
    assert "proxyAdminUrl" not in policy["target"] and "metrics" not in policy
    assert policy["target"]["proxyAdminTokenSecretRef"]["name"] == one(objects, "Secret")["metadata"]["name"]


def test_both_examples_run_the_replicas_asked_for(tmp_path: Path) -> None:
    values = {"examples": {"kvtuneEngine": {**ENGINE_ON["examples"]["kvtuneEngine"], "replicas": 3},
                           "vllmProxy": {**VLLM_PROXY_ON["examples"]["vllmProxy"], "replicas": 3}}}  # fmt: skip
    objects = render(values, tmp_path)
    replicas = {
        d["metadata"]["name"]: d["spec"]["replicas"]
        for d in by_kind(objects, "Deployment")
        if d["metadata"]["name"].startswith("kvtune-example-")
    }
    assert replicas == {"kvtune-example-engine": 3, "kvtune-example-vllm": 3}
    assert all("podEndpoints" in p["spec"]["target"] for p in by_kind(objects, "KVTuningPolicy"))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicas": "two"}, "at '/replicas': got string, want integer"),
        ({"replicas": 0}, "at '/replicas'"),
        ({"replica": 2}, "additional properties 'replica' not allowed"),
        ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0'"),
        ({"adminTokenSecrets": "llama-admin"}, "at '/adminTokenSecrets': got string, want array"),
        ({"monitoring": {"force": "yes"}}, "at '/monitoring/force': got string, want boolean"),
        ({"examples": {"kvtuneEngine": {"policyMode": "Act"}}}, "at '/examples/kvtuneEngine/policyMode'"),
        ({"clusterWide": True, "watchNamespaces": ["team-a"]}, "clusterWide: true watches every namespace"),
        ({"examples": {"vllmProxy": {"enabled": True}}}, "examples.vllmProxy.modelClaimName is required"),
        ({"maxMode": "Act"}, "at '/maxMode'"),
        (
            {"monitoring": {"force": True, "podMonitor": {"enabled": True}}},
            "monitoring.podMonitor.selector is required",
        ),
        ({"monitoring": {"serviceMonitor": {"interval": "soon"}}}, "at '/monitoring/serviceMonitor/interval'"),
        ({"examples": {"kvtuneEngine": {"enabled": True}}}, "examples.kvtuneEngine.image.repository is not set"),
        (
            {"examples": {"vllmProxy": {**VLLM_PROXY_ON["examples"]["vllmProxy"], "vllmImage": {"tag": ""}}}},
            "examples.vllmProxy.vllmImage.tag is required",
        ),
        (
            {"examples": {"vllmProxy": {**VLLM_PROXY_ON["examples"]["vllmProxy"], "proxyImage": {"repository": ""}}}},
            "examples.vllmProxy.proxyImage.repository is not set",
        ),
    ],
    ids=[
        "replicas-string", "replicas-zero", "unknown-top-level-key", "bad-namespace", "secrets-not-a-list",
        "force-not-bool", "unknown-mode", "cluster-wide-with-namespaces", "vllm-without-model", "max-mode-unknown",
        "pod-monitor-without-selector", "bad-interval", "engine-without-image", "vllm-without-tag",
        "proxy-without-image",
    ],
)  # fmt: skip
def test_a_wrong_value_fails_with_a_message_naming_it(
    tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    done = template(values, tmp_path)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_without_an_image_repository_the_install_fails_and_says_what_to_do(tmp_path: Path) -> None:
    """Nothing publishes kvtune's images: a default that named one would end in ImagePullBackOff."""
    done = template({}, tmp_path, bare=True)
    assert done.returncode != 0
    assert "image.repository is not set: build the image (scripts/build_image.sh" in done.stderr, done.stderr


@pytest.mark.parametrize("mode", ["Observe", "Recommend", "Apply"])
def test_max_mode_is_the_operators_ceiling(tmp_path: Path, mode: str) -> None:
    args = operator_args(render({"maxMode": mode}, tmp_path))
    assert args[args.index("--max-mode") + 1] == mode


def test_the_service_monitor_keeps_the_operators_namespace_label_and_takes_the_usual_knobs(
    tmp_path: Path,
) -> None:
    monitor = one(render({}, tmp_path, (MONITORING_API,)), "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True  # else `namespace` becomes exported_namespace
    assert endpoint["interval"] == "30s" and "scrapeTimeout" not in endpoint
    knobs = {
        "namespace": "monitoring",
        "labels": {"release": "prom"},
        "serviceMonitor": {
            "interval": "15s",
            "scrapeTimeout": "10s",
            "labels": {"team": "ml"},
            "relabelings": [{"targetLabel": "cluster", "replacement": "gpu-1"}],
            "metricRelabelings": [{"action": "drop", "regex": "python_.*", "sourceLabels": ["__name__"]}],
        },
    }
    objects = render({"monitoring": knobs}, tmp_path, (MONITORING_API,))
    monitor = one(objects, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}  # the operator's Service stays
    assert {"release": "prom", "team": "ml"}.items() <= monitor["metadata"]["labels"].items()
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("15s", "10s")
    assert endpoint["relabelings"] == knobs["serviceMonitor"]["relabelings"]
    assert endpoint["metricRelabelings"] == knobs["serviceMonitor"]["metricRelabelings"]
    assert one(objects, "PrometheusRule")["metadata"]["namespace"] == "monitoring"


def test_the_pod_monitor_scrapes_engines_and_proxies_with_the_labels_the_dashboards_read(
    tmp_path: Path,
) -> None:
    objects = render({**POD_MONITOR_ON, "watchNamespaces": ["team-a", "team-b"]}, tmp_path, (MONITORING_API,))
    monitor = one(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"] == {"matchLabels": {"app": "llama-vllm"}}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}  # the watched ones
    engine, proxy = monitor["spec"]["podMetricsEndpoints"]
    assert (engine["port"], proxy["port"]) == ("http", "proxy")
    for endpoint in (engine, proxy):
        assert endpoint["honorLabels"] is True  # an engine's own model_name wins
        assert endpoint["relabelings"][0] == {
            "sourceLabels": ["__meta_kubernetes_pod_label_kvtune_dev_model_name"],
            "regex": "(.+)",
            "targetLabel": "model_name",
        }
    wide = one(render({**POD_MONITOR_ON, "clusterWide": True}, tmp_path, (MONITORING_API,)), "PodMonitor")
    assert wide["spec"]["namespaceSelector"] == {"any": True}
    named = {
        "monitoring": {"podMonitor": {**POD_MONITOR_ON["monitoring"]["podMonitor"], "namespaces": ["x"]}}
    }
    assert one(render(named, tmp_path, (MONITORING_API,)), "PodMonitor")["spec"]["namespaceSelector"] == {
        "matchNames": ["x"]
    }


def test_the_vllm_example_pods_carry_their_model_name_for_the_pod_monitor(tmp_path: Path) -> None:
    (deployment,) = [
        d
        for d in by_kind(render(VLLM_PROXY_ON, tmp_path), "Deployment")
        if d["metadata"]["name"] == "kvtune-example-vllm"
    ]
    assert deployment["spec"]["template"]["metadata"]["labels"]["kvtune.dev/model-name"] == "model"


def alerts(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rule = one(objects, "PrometheusRule")
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r}


def test_the_prometheus_rule_takes_labels_disabled_alerts_for_and_the_runbook_base(tmp_path: Path) -> None:
    default = alerts(render({}, tmp_path, (MONITORING_API,)))
    for name, alert in default.items():
        url = alert["annotations"]["runbook_url"]
        assert (REPO / url.split("/blob/", 1)[1].split("/", 1)[1]).is_file(), f"{name}: {url}"
    knobs = {
        "additionalRuleLabels": {"team": "ml-platform", "severity": "info"},
        "disabled": ["KVCachePreemptions"],
        "for": {"KVCacheSaturated": "30m"},
        "runbookBaseUrl": "https://wiki.example.com/runbooks/",
        "prometheusUrl": "http://prometheus.obs:9090",
    }
    tuned = alerts(render({"monitoring": {"prometheusRule": knobs}}, tmp_path, (MONITORING_API,)))
    assert set(tuned) == set(default) - {"KVCachePreemptions"}
    assert tuned["KVCacheSaturated"]["for"] == "30m" and tuned["KVCachePreemptionStorm"]["for"] == "5m"
    for name, alert in tuned.items():
        assert alert["labels"]["team"] == "ml-platform"
        assert alert["labels"]["severity"] == default[name]["labels"]["severity"]  # its own severity stays
        assert alert["annotations"]["runbook_url"] == f"https://wiki.example.com/runbooks/{name}.md"
    doctor = tuned["KVCachePreemptionStorm"]["annotations"]["doctor"]
    assert doctor.startswith("kvtune doctor --prometheus http://prometheus.obs:9090 --selector ")
    assert "doctor" not in tuned["KVTuneOperatorDown"]["annotations"]


def test_no_doctor_command_execs_into_the_operator(tmp_path: Path) -> None:
    """The doctor runs where on-call is, with Prometheus' URL: an exec into the operator's pod would hand them
    its token, which may patch workloads."""
    done = template({}, tmp_path, (MONITORING_API,))
    assert done.returncode == 0, done.stderr
    values = tmp_path / "values.yaml"
    from tests.chart.helm import CHART, helm

    renamed = helm("template", "llm-tuner", CHART, "--namespace", "platform", "-f", values,
                   "--api-versions", MONITORING_API)  # fmt: skip
    assert renamed.returncode == 0, renamed.stderr
    import yaml

    objects = [doc for doc in yaml.safe_load_all(renamed.stdout) if doc]
    doctors = {
        name: a["annotations"]["doctor"]
        for name, a in alerts(objects).items()
        if "doctor" in a["annotations"]
    }
    assert doctors and all(d.startswith("kvtune doctor --prometheus ") for d in doctors.values()), doctors
    assert "exec" not in renamed.stdout.split("kind: PrometheusRule", 1)[1].split("\n---", 1)[0]


def test_the_uninstall_hook_deletes_policies_only_when_asked_and_may_do_nothing_else(tmp_path: Path) -> None:
    assert by_kind(render({}, tmp_path), "Job") == []
    objects = render(
        {"uninstall": {"deletePolicies": True}, "watchNamespaces": ["team-a", "team-b"]}, tmp_path
    )
    job = one(objects, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{OPERATOR_IMAGE}:0.1.0"
    assert container["args"] == ["operator", "--delete-policies", "--timeout", "120",
                                 "--namespace", "team-a", "--namespace", "team-b"]  # fmt: skip
    hook_roles = [r for r in by_kind(objects, "Role") if r["metadata"]["name"] == "kvtune-delete-policies"]
    assert sorted(r["metadata"]["namespace"] for r in hook_roles) == ["team-a", "team-b"]
    for role in hook_roles:
        assert role["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
        assert role["rules"] == [{"apiGroups": ["kvtune.dev"], "resources": ["kvtuningpolicies"],
                                  "verbs": ["list", "delete"]}]  # fmt: skip
    wide = render({"uninstall": {"deletePolicies": True}, "clusterWide": True}, tmp_path)
    assert "--all-namespaces" in one(wide, "Job")["spec"]["template"]["spec"]["containers"][0]["args"]
    hook_cluster_roles = [
        r for r in by_kind(wide, "ClusterRole") if r["metadata"]["name"] == "kvtune-delete-policies"
    ]
    assert len(hook_cluster_roles) == 1


def test_the_chart_works_as_a_subchart_with_global_values(tmp_path: Path) -> None:
    assert render({"global": {"imageRegistry": "registry.example.com"}}, tmp_path)


def notes(tmp_path: Path, values: dict[str, Any]) -> str:
    """What `helm install` prints after installing (NOTES.txt), from a client-side dry run."""
    from tests.chart.helm import BASE_VALUES, CHART, RELEASE, helm, merged

    values_file = tmp_path / "notes-values.yaml"
    values_file.write_text(json.dumps(merged(BASE_VALUES, values)))
    done = helm("install", RELEASE, CHART, "--namespace", NAMESPACE, "--dry-run=client", "-f", values_file)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("NOTES:", 1)[1]


@pytest.mark.parametrize(
    "values",
    [
        {"watchNamespaces": ["team-a", "team-b"]},
        {"clusterWide": True},
        {"uninstall": {"deletePolicies": True}},
    ],
    ids=["namespaces", "cluster-wide", "uninstall-hook"],
)
def test_every_command_the_notes_print_names_its_namespace(tmp_path: Path, values: dict[str, Any]) -> None:
    text = notes(tmp_path, values)
    commands = [line.strip() for line in text.splitlines() if line.strip().startswith(("kubectl ", "helm "))]
    assert commands
    for command in commands:
        assert " -n " in command or "--all-namespaces" in command or " -n" in command.split("#")[0], command
    assert f"{OPERATOR_IMAGE}:0.1.0" in text and "Recommend" in text
