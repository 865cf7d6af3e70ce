"""The operator chart, rendered with ``helm template``: every toggle, the RBAC contract with the operator,
the settings contract (env → OperatorSettings), generated files in sync, manifests valid for 1.36."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartkit import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    REPO,
    Manifest,
    Render,
    RenderError,
    env_of,
    find,
    kinds,
    operator_container,
    run_helm,
)

from omnimodel_operator import __version__
from omnimodel_operator import constants as C
from omnimodel_operator.accelerators import ACCELERATORS
from omnimodel_operator.crdgen import build_crd
from omnimodel_operator.kinds import CHILD_KINDS
from omnimodel_operator.kube import RESOURCES
from omnimodel_operator.settings import DEFAULT_RUNTIME_IMAGES, OperatorSettings

FULLNAME = "omni-omnimodel-operator"
METRICS_SERVICE = f"{FULLNAME}-metrics"
CLUSTER_ROLE = f"{NAMESPACE}-{FULLNAME}"
CHART_YAML = yaml.safe_load((CHART / "Chart.yaml").read_text())

# Every mode the tests render; kubernetes-validate checks each of them.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["ml", "team-a"]},
    "no-crds-no-rbac": {"crds": {"enabled": False}, "rbac": {"create": False}, "serviceAccount": {"create": False}},
    "no-metrics": {"metrics": {"enabled": False}},
    "service-monitor": {
        "metrics": {
            "port": 9100,
            "service": {"annotations": {"prometheus.io/scrape": "true"}},
            "serviceMonitor": {
                "enabled": True,
                "interval": "15s",
                "scrapeTimeout": "10s",
                "labels": {"release": "prom"},
            },
        }
    },
    "everything-set": {
        "image": {"repository": "registry.local/op", "tag": "dev", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "crds": {"keep": False},
        "runtime": {"repository": "registry.local/rt", "tag": "1.2.3", "images": {"cpu": "registry.local/cpu:x"}},
        "operator": {
            "resyncInterval": 2.5,
            "apiStartupTimeout": 12,
            "networkPolicy": False,
            "healthPort": 9090,
            "verbose": True,
            "extraEnv": [{"name": "EXTRA", "value": "1"}],
        },
        "metrics": {"port": 9091},
        "serviceAccount": {"annotations": {"iam.example.com/role": "omni"}},
        "podAnnotations": {"a": "b"},
        "podLabels": {"team": "ml"},
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}
                    ]
                }
            }
        },
        "priorityClassName": "system-cluster-critical",
    },
}


def rules_of(role: Manifest) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def expected_namespaced_rules() -> dict[tuple[str, str], set[str]]:
    """What the operator does in a namespace it reconciles, derived from its own tables."""
    rules: dict[tuple[str, str], set[str]] = {
        # handlers: kopf indexes and event handlers list and watch OmniModels (they write nothing to them).
        (C.GROUP, C.PLURAL): {"list", "watch"},
        # reconcile.write_status: merge patch of the status subresource.
        (C.GROUP, f"{C.PLURAL}/status"): {"patch"},
        # handlers.pods: the pods index (list + watch) explains a stage that is not ready.
        ("", "pods"): {"list", "watch"},
        # reconcile.transition_event and kopf's warnings.
        ("", "events"): {"create"},
        # reconcile's missing-Secret check reads a named Secret (apiKeySecret, tokenSecret) by name.
        ("", "secrets"): {"get"},
    }
    for child in CHILD_KINDS:
        plural, namespaced = RESOURCES[(child.api_version, child.kind)]
        assert namespaced and plural == child.plural
        # server-side apply (patch; create for new objects), get (name conflicts), list + watch (the
        # kopf index the controller reads), delete to prune.
        rules[(child.group, child.plural)] = {"create", "patch", "get", "list", "watch", "delete"}
    # autoscaler.loop: replicas of autoscaled stages through the scale subresource.
    rules[("apps", "deployments/scale")] = {"patch"}
    return rules


CRD_RULE = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
NAMESPACE_RULE = {("", "namespaces"): {"list", "watch"}}
PEERING = CLUSTER_ROLE  # the kopf peering object's name
# kopf peering: list and watch the peering objects, patch the release's own (keep-alives).
CLUSTER_PEERING_RULE = {("kopf.dev", "clusterkopfpeerings"): {"list", "watch", "patch"}}
PEERING_RULE = {("kopf.dev", "kopfpeerings"): {"list", "watch", "patch"}}
# The `helm test` hook's own account, Role and RoleBinding, and its Job.
TEST_HOOK_KINDS = ["ServiceAccount", "Role", "RoleBinding", "Job"]


# ------------------------------------------------------------------------------------------- lint, files


@pytest.mark.parametrize("values", ["defaults", "namespaced"])
def test_helm_lint_strict(helm: str, tmp_path: Path, values: str) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(VALUE_SETS[values]))
    proc = run_helm(helm, "lint", "--strict", str(CHART), "--values", str(path), "--kube-version", KUBE_VERSION)
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


def test_chart_metadata_matches_operator_version() -> None:
    assert CHART_YAML["apiVersion"] == "v2"
    assert CHART_YAML["appVersion"] == __version__ == "0.1.0"


@pytest.mark.parametrize("script", ["gen_crd.py", "gen_values_schema.py"])
def test_generated_files_are_up_to_date(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(CHART / "hack" / script), "--check"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, f"{script} --check: {proc.stderr} (run `make chart-generate`)"


# ------------------------------------------------------------------------------------ default render


def test_default_render_has_exactly_the_operator_objects(render: Render) -> None:
    manifests = render()
    assert kinds(manifests) == sorted(
        [
            "ServiceAccount", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Deployment",
            "Service", "ClusterKopfPeering", *TEST_HOOK_KINDS,
        ]
    )  # fmt: skip
    for m in manifests:
        if m["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"):
            assert m["metadata"]["namespace"] == NAMESPACE, m["kind"]


def test_deployment_runs_one_operator_with_kopf_health_probes(render: Render) -> None:
    manifests = render()
    deployment = find(manifests, "Deployment", FULLNAME)
    assert deployment["spec"]["replicas"] == 1
    # Rolling: the old operator stays until the new pod is ready; kopf peering keeps them from acting at once.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["serviceAccountName"] == FULLNAME
    container = operator_container(manifests)
    assert container["image"] == f"ghcr.io/omnimodel/omnimodel-operator:{__version__}"
    assert container["command"] == ["omnimodel-operator"]
    assert container["args"] == [
        "run", "--liveness=http://0.0.0.0:8080/healthz", "--metrics-host=0.0.0.0", f"--peering={PEERING}"
    ]  # fmt: skip
    # kopf's peering identity: the pod's name.
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    peering = find(manifests, "ClusterKopfPeering", PEERING)
    assert peering["apiVersion"] == "kopf.dev/v1" and "status" not in peering
    assert container["ports"] == [
        {"name": "health", "containerPort": 8080, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8081, "protocol": "TCP"},
    ]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe


def test_pod_is_non_root_read_only_without_capabilities(render: Render) -> None:
    manifests = render()
    pod = find(manifests, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = operator_container(manifests)
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # The read-only root leaves /tmp as the only writable path.
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"][0]["name"] == "tmp" and "emptyDir" in pod["volumes"][0]


# ------------------------------------------------------------------------- settings contract (env)


def test_default_env_is_exactly_the_operator_defaults(render: Render, monkeypatch: pytest.MonkeyPatch) -> None:
    env = env_of(operator_container(render()))
    assert json.loads(env["OMNIMODEL_RUNTIME_IMAGES"]) == DEFAULT_RUNTIME_IMAGES
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert OperatorSettings() == OperatorSettings.model_construct(
        runtime_images=DEFAULT_RUNTIME_IMAGES,
        image_pull_policy="IfNotPresent",
        resync_interval=600.0,
        workers=4,
        event_coalesce_seconds=0.2,
        retry_base_delay=0.5,
        retry_max_delay=300.0,
        stage_requests={"cpu": "500m", "memory": "2Gi"},
        device_requests={"cpu": "2", "memory": "16Gi"},
        gateway_requests={"cpu": "250m", "memory": "512Mi"},
        fetch_requests={"cpu": "500m", "memory": "1Gi"},
        limit_ratios={"cpu": 4.0, "memory": 1.0},
        scrape_from={},
        vllm_omni_images={"nvidia": "vllm/vllm-omni:v0.30.0", "amd": "vllm/vllm-omni-rocm:v0.30.0"},
        autoscale_interval=10.0,
        autoscale_scrape_timeout=2.0,
        vllm_omni_env={},
        namespaces=[],
        network_policy=True,
        health_port=8080,
        metrics_port=8081,
        api_startup_timeout=30.0,
    )


def test_every_operator_setting_is_set_by_the_chart(render: Render) -> None:
    env = env_of(operator_container(render()))
    fields = {f"OMNIMODEL_{name.upper()}" for name in OperatorSettings.model_fields}
    assert fields == {k for k in env if k.startswith("OMNIMODEL_")}


def test_operator_values_reach_the_operator_settings(render: Render, monkeypatch: pytest.MonkeyPatch) -> None:
    container = operator_container(render(VALUE_SETS["everything-set"]))
    env = env_of(container)
    assert env["EXTRA"] == "1"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = OperatorSettings()
    assert settings.resync_interval == 2.5
    assert settings.api_startup_timeout == 12
    assert settings.network_policy is False
    assert settings.health_port == 9090
    assert settings.metrics_port == 9091
    assert settings.image_pull_policy == "IfNotPresent"
    assert container["args"] == [
        "run", "--liveness=http://0.0.0.0:9090/healthz", "--metrics-host=0.0.0.0", f"--peering={PEERING}",
        "--verbose",
    ]  # fmt: skip
    assert [p["containerPort"] for p in container["ports"]] == [9090, 9091]


def test_runtime_image_per_vendor_follows_the_accelerator_table(render: Render) -> None:
    env = env_of(operator_container(render({"runtime": {"repository": "registry.local/rt", "tag": "9.9"}})))
    images = json.loads(env["OMNIMODEL_RUNTIME_IMAGES"])
    # Only vendors with a published image get one: the operator refuses the others' stages instead.
    assert images == {
        v.value: f"registry.local/rt:9.9-{spec.image_variant}"
        for v, spec in ACCELERATORS.items()
        if spec.has_runtime_image
    }


def test_runtime_images_name_the_vendors_without_a_published_image(render: Render) -> None:
    own = {"intel": "registry.local/rt:xpu", "ascend": "registry.local/rt:cann"}
    env = env_of(operator_container(render({"runtime": {"images": own}})))
    assert json.loads(env["OMNIMODEL_RUNTIME_IMAGES"]) == {**DEFAULT_RUNTIME_IMAGES, **own}


def test_runtime_image_override_replaces_one_vendor_only(render: Render) -> None:
    env = env_of(operator_container(render({"runtime": {"images": {"nvidia": "registry.local/rt:h200"}}})))
    images = json.loads(env["OMNIMODEL_RUNTIME_IMAGES"])
    assert images == {**DEFAULT_RUNTIME_IMAGES, "nvidia": "registry.local/rt:h200"}


def test_runtime_image_for_an_unknown_vendor_is_rejected(render_error: RenderError) -> None:
    assert "tpu" in render_error({"runtime": {"images": {"tpu": "x"}}})


def test_runtime_pull_policy_goes_to_the_children(render: Render) -> None:
    env = env_of(operator_container(render({"runtime": {"imagePullPolicy": "Always"}})))
    assert env["OMNIMODEL_IMAGE_PULL_POLICY"] == "Always"


# -------------------------------------------------------------------------------------------- image


def test_image_overrides(render: Render) -> None:
    manifests = render(VALUE_SETS["everything-set"])
    container = operator_container(manifests)
    assert container["image"] == "registry.local/op:dev"
    assert container["imagePullPolicy"] == "Always"
    pod = find(manifests, "Deployment")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_image_digest_pins_the_image(render: Render) -> None:
    digest = "sha256:" + "a" * 64
    container = operator_container(render({"image": {"tag": "ignored", "digest": digest}}))
    assert container["image"] == f"ghcr.io/omnimodel/omnimodel-operator@{digest}"


def test_bad_values_are_rejected_by_the_schema(render_error: RenderError) -> None:
    assert "pullPolicy" in render_error({"image": {"pullPolicy": "Sometimes"}})
    assert "replicas" in render_error({"replicas": 2})  # one operator, not configurable
    assert "resyncInterval" in render_error({"operator": {"resyncInterval": 0}})
    assert "watchNamespaces" in render_error({"watchNamespaces": ["Not_A_Namespace"]})
    assert "port" in render_error({"metrics": {"port": 0}})  # 0 is the operator's "off": use metrics.enabled
    assert "interval" in render_error({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}})
    assert "serviceMonitor" in render_error({"metrics": {"serviceMonitor": {"intervall": "30s"}}})


# ------------------------------------------------------------------------------------- pod placement


def test_resources_and_placement(render: Render) -> None:
    manifests = render(VALUE_SETS["everything-set"])
    values = VALUE_SETS["everything-set"]
    deployment = find(manifests, "Deployment")
    pod = deployment["spec"]["template"]
    assert operator_container(manifests)["resources"] == values["resources"]
    assert pod["spec"]["nodeSelector"] == values["nodeSelector"]
    assert pod["spec"]["tolerations"] == values["tolerations"]
    assert pod["spec"]["affinity"] == values["affinity"]
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    assert pod["metadata"]["annotations"] == {"a": "b"}
    assert pod["metadata"]["labels"]["team"] == "ml"
    # The helm test Job lands where the operator may run.
    job = find(manifests, "Job")["spec"]["template"]["spec"]
    assert job["nodeSelector"] == values["nodeSelector"]
    assert job["tolerations"] == values["tolerations"]


def test_default_resources_request_and_cap_memory(render: Render) -> None:
    resources = operator_container(render())["resources"]
    assert resources["requests"] == {"cpu": "50m", "memory": "128Mi"}
    assert resources["limits"] == {"memory": "512Mi"}
    assert "cpu" not in resources["limits"]


def test_no_placement_keys_by_default(render: Render) -> None:
    pod = find(render(), "Deployment")["spec"]["template"]["spec"]
    assert not {"nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"} & set(pod)


# --------------------------------------------------------------------------------------------- CRD


def test_crd_is_the_operator_generated_crd_and_kept_by_default(render: Render) -> None:
    crd = find(render(), "CustomResourceDefinition", C.CRD_NAME)
    source = build_crd()
    assert crd["spec"] == source["spec"]
    committed = yaml.safe_load((REPO / "crds" / "omnimodel.io_omnimodels.yaml").read_text())
    assert crd["spec"] == committed["spec"], "crds/ drifted from the API models: run `make crds`"
    assert source["metadata"]["labels"].items() <= crd["metadata"]["labels"].items()
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_crd_keep_false_lets_uninstall_delete_it(render: Render) -> None:
    crd = find(render({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]


def test_crds_disabled_renders_no_crd(render: Render) -> None:
    assert "CustomResourceDefinition" not in kinds(render({"crds": {"enabled": False}}))


# -------------------------------------------------------------------------------------------- RBAC


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses(render: Render) -> None:
    manifests = render()
    role = find(manifests, "ClusterRole", CLUSTER_ROLE)
    assert rules_of(role) == {**expected_namespaced_rules(), **CRD_RULE, **CLUSTER_PEERING_RULE}
    binding = find(manifests, "ClusterRoleBinding", CLUSTER_ROLE)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": CLUSTER_ROLE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    # The only Role and RoleBinding are the `helm test` hook's.
    assert [m["metadata"]["name"] for m in manifests if m["kind"] in ("Role", "RoleBinding")] == [
        f"{FULLNAME}-test"
    ] * 2


def test_watch_namespaces_get_a_role_each_and_a_small_cluster_role(render: Render) -> None:
    manifests = render(VALUE_SETS["namespaced"])
    assert rules_of(find(manifests, "ClusterRole", CLUSTER_ROLE)) == {**CRD_RULE, **NAMESPACE_RULE}
    for ns in ("ml", "team-a"):
        role = find(manifests, "Role", FULLNAME, ns)
        assert rules_of(role) == {**expected_namespaced_rules(), **PEERING_RULE}
        assert find(manifests, "KopfPeering", PEERING, ns)["apiVersion"] == "kopf.dev/v1"
        binding = find(manifests, "RoleBinding", FULLNAME, ns)
        assert binding["roleRef"]["name"] == FULLNAME and binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    assert kinds(manifests).count("Role") == 3  # and the `helm test` hook's
    assert "ClusterKopfPeering" not in kinds(manifests)
    env = env_of(operator_container(manifests))
    assert json.loads(env["OMNIMODEL_NAMESPACES"]) == ["ml", "team-a"]


@pytest.mark.parametrize("values", ["defaults", "namespaced"])
def test_rbac_has_no_wildcards_and_reads_secrets_only_by_name(render: Render, values: str) -> None:
    for role in (m for m in render(VALUE_SETS[values]) if m["kind"] in ("Role", "ClusterRole")):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], (role["metadata"]["name"], rule)
            if "secrets" in rule["resources"]:
                # A Secret named by an OmniModel is read by name; never listed or watched (their data).
                assert rule["resources"] == ["secrets"] and rule["verbs"] == ["get"], rule
            assert not set(rule["verbs"]) & {"escalate", "bind", "impersonate", "update", "deletecollection"}
            assert "nonResourceURLs" not in rule


def test_rbac_rules_are_commented_by_purpose() -> None:
    text = (CHART / "templates" / "_rbac.tpl").read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("- apiGroups:"):
            assert lines[i - 1].lstrip().startswith("#"), f"_rbac.tpl:{i + 1}: rule without a purpose comment"


def test_existing_service_account_and_no_rbac(render: Render) -> None:
    manifests = render({"serviceAccount": {"create": False, "name": "platform-operator"}, "rbac": {"create": False}})
    assert kinds(manifests) == sorted(
        ["CustomResourceDefinition", "Deployment", "Service", "ClusterKopfPeering", *TEST_HOOK_KINDS]
    )
    assert find(manifests, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"


def test_service_account_binding_follows_its_name(render: Render) -> None:
    manifests = render({"serviceAccount": {"name": "omni-sa", "annotations": {"k": "v"}}})
    sa = find(manifests, "ServiceAccount", "omni-sa")
    assert sa["metadata"]["annotations"] == {"k": "v"}
    assert sa["automountServiceAccountToken"] is True
    assert find(manifests, "ClusterRoleBinding")["subjects"][0]["name"] == "omni-sa"


# ---------------------------------------------------------------------------------- metrics, test hook


def test_metrics_service_targets_the_operator_metrics_port(render: Render) -> None:
    manifests = render()
    service = find(manifests, "Service", METRICS_SERVICE, NAMESPACE)
    assert "annotations" not in service["metadata"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]
    # Selects the operator pod, and only it (the helm test pod carries other labels).
    pod_labels = find(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    job_labels = find(manifests, "Job")["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= job_labels.items()
    ports = {p["name"]: p["containerPort"] for p in operator_container(manifests)["ports"]}
    assert ports["metrics"] == int(env_of(operator_container(manifests))["OMNIMODEL_METRICS_PORT"])


def test_metrics_disabled_means_no_endpoint_and_no_service(render: Render, monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = render(VALUE_SETS["no-metrics"])
    assert "Service" not in kinds(manifests)
    container = operator_container(manifests)
    assert [p["name"] for p in container["ports"]] == ["health"]
    for name, value in env_of(container).items():
        monkeypatch.setenv(name, value)
    assert OperatorSettings().metrics_port == 0  # the operator's "serve no metrics"


def test_no_service_monitor_by_default(render: Render) -> None:
    assert "ServiceMonitor" not in kinds(render())


def test_service_monitor_scrapes_the_metrics_service(render: Render) -> None:
    manifests = render(VALUE_SETS["service-monitor"])
    monitor = find(manifests, "ServiceMonitor", FULLNAME, NAMESPACE)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/instance"] == "omni"
    service = find(manifests, "Service", METRICS_SERVICE)
    assert service["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {
        "port": "metrics",
        "path": "/metrics",
        "scheme": "http",
        "interval": "15s",
        "scrapeTimeout": "10s",
    }
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
    assert service["spec"]["ports"][0]["port"] == 9100
    assert env_of(operator_container(manifests))["OMNIMODEL_METRICS_PORT"] == "9100"


def test_service_monitor_defaults_leave_the_timeout_to_prometheus(render: Render) -> None:
    monitor = find(render({"metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "scheme": "http", "interval": "30s"}
    ]


def test_service_monitor_without_metrics_is_refused(render_error: RenderError) -> None:
    error = render_error({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}})
    assert "metrics.serviceMonitor.enabled needs metrics.enabled" in error


def test_metrics_port_must_differ_from_the_health_port(render_error: RenderError) -> None:
    assert "need a port each" in render_error({"metrics": {"port": 9090}, "operator": {"healthPort": 9090}})


def test_helm_test_job_reconciles_an_omnimodel_with_an_account_of_its_own(render: Render) -> None:
    manifests = render(VALUE_SETS["namespaced"])
    test = f"{FULLNAME}-test"
    job = find(manifests, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "test"
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == test
    assert pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert env_of(container) == {
        "OMNIMODEL_TEST_NAMESPACE": "ml",
        "OMNIMODEL_TEST_NAME": "omni-helm-test",
        "OMNIMODEL_TEST_TIMEOUT": "120",
    }
    assert float(env_of(container)["OMNIMODEL_TEST_TIMEOUT"]) < job["spec"]["activeDeadlineSeconds"]
    script = container["command"][2]
    compile(script, "helm-test", "exec")  # a syntax error would only show in the cluster
    assert "observedGeneration" in script
    # Its RBAC: hooks created before the Job, in the watched namespace, for its OmniModel only.
    for kind, ns in (("ServiceAccount", NAMESPACE), ("Role", "ml"), ("RoleBinding", "ml")):
        hook = find(manifests, kind, test, ns)
        assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert int(hook["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0
    assert rules_of(find(manifests, "Role", test, "ml")) == {
        (C.GROUP, C.PLURAL): {"create", "get", "delete"},
        ("apps", "deployments"): {"list"},
    }
    assert find(manifests, "RoleBinding", test, "ml")["subjects"] == [
        {"kind": "ServiceAccount", "name": test, "namespace": NAMESPACE}
    ]
    # Never selected by the operator Deployment.
    selector = find(manifests, "Deployment")["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()


def test_helm_test_in_cluster_wide_mode_uses_the_release_namespace(render: Render) -> None:
    manifests = render()
    assert env_of(find(manifests, "Job")["spec"]["template"]["spec"]["containers"][0])["OMNIMODEL_TEST_NAMESPACE"] == (
        NAMESPACE
    )
    assert find(manifests, "Role", f"{FULLNAME}-test")["metadata"]["namespace"] == NAMESPACE


def test_peering_disabled_is_standalone_and_recreate(render: Render) -> None:
    manifests = render({"peering": {"enabled": False}})
    assert find(manifests, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    container = operator_container(manifests)
    assert not [a for a in container["args"] if a.startswith("--peering")]
    assert "POD_ID" not in {e["name"] for e in container["env"]}
    assert "ClusterKopfPeering" not in kinds(manifests)
    assert ("kopf.dev", "clusterkopfpeerings") not in rules_of(find(manifests, "ClusterRole", CLUSTER_ROLE))


def test_peering_crds_are_kopfs_in_the_crds_folder() -> None:
    """Helm installs crds/ before the templates (whose peering object needs them) and never deletes them."""
    docs = list(yaml.safe_load_all((CHART / "crds" / "kopf-peering.yaml").read_text()))
    assert {(d["spec"]["names"]["kind"], d["spec"]["scope"]) for d in docs} == {
        ("ClusterKopfPeering", "Cluster"),
        ("KopfPeering", "Namespaced"),
    }
    for d in docs:
        assert d["spec"]["group"] == "kopf.dev" and [v["name"] for v in d["spec"]["versions"]] == ["v1"]
        # No status subresource: kopf patches `status` through the object, which is what the RBAC grants.
        assert "subresources" not in d["spec"]["versions"][0]


# ------------------------------------------------------------------------------------------- naming


def test_fullname_override_and_name_length(render: Render) -> None:
    manifests = render({"fullnameOverride": "x" * 80, "watchNamespaces": ["ml"]})
    deployment = find(manifests, "Deployment")
    assert deployment["metadata"]["name"] == "x" * 63
    for m in manifests:
        if m["kind"] in ("Deployment", "ServiceAccount", "Role", "RoleBinding", "Job", "Service"):
            assert len(m["metadata"]["name"]) <= 63, m["kind"]
    assert find(manifests, "Service")["metadata"]["name"] == "x" * 55 + "-metrics"


# ------------------------------------------------------------------------------------------ validity


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_rendered_manifests_validate_against_kubernetes_schemas(render: Render, values: str) -> None:
    import kubernetes_validate

    validate = kubernetes_validate.validate
    for manifest in render(VALUE_SETS[values]):
        # Not Kubernetes kinds (Prometheus Operator's and kopf's CRDs): checked field by field by their own tests.
        if manifest["apiVersion"].startswith(("monitoring.coreos.com/", "kopf.dev/")):
            continue
        validate(manifest, KUBE_VERSION, strict=True)


def test_labels_are_the_recommended_set(render: Render) -> None:
    for m in render():
        labels: dict[str, Any] = m["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "omni", m["kind"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", m["kind"]
        assert labels["helm.sh/chart"] == f"omnimodel-operator-{CHART_YAML['version']}", m["kind"]
