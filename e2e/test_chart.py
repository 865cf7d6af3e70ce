"""The operator's Helm chart on the local control plane: install, RBAC, a real operator run, upgrade,
uninstall.

Here (kwok only fakes the pod's lifecycle) the operator runs as a local process with exactly the pod's
command and environment, taken from the installed Deployment, and with a token of the chart's
ServiceAccount (TokenRequest API): every API call it makes goes through the chart's RBAC
(omnimodel_testbed.operator_process). `make demo` and `make e2e-serving` run the chart's operator pod
from its image instead (omnimodel_testbed.operator_pod).

The release watches one fresh namespace (watchNamespaces), so the operator run here never touches
other suites' objects. The CRD is shared by every suite on the cluster: an existing one is adopted
into the release, and it is never deleted (crds.keep stays true).

The tests run in file order against one release: install → objects → RBAC → operator → helm test →
upgrade → uninstall. Each only assumes that the release is installed when it starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnimodel_testbed.operator_process import ChartOperator, service_account_kubeconfig
from omnimodel_testbed.pytest_plugin import ClusterHandle
from support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "omnimodel-operator"
EXAMPLE = REPO / "examples" / "text-tiny.yaml"
CRD = "omnimodels.omnimodel.io"
RELEASE = "omni-e2e"
FULLNAME = f"{RELEASE}-omnimodel-operator"
# helm keeps repositories/plugins state under these: keep it out of the user's home.
HELM_HOME = {f"HELM_{kind.upper()}_HOME": f"/tmp/omnimodel-e2e-helm/{kind}" for kind in ("cache", "config", "data")}


@dataclass(frozen=True)
class Release:
    cluster: ClusterHandle
    namespace: str  # where the operator and its ServiceAccount live
    watched: str  # the namespace it reconciles

    @property
    def cluster_role(self) -> str:
        return f"{self.namespace}-{FULLNAME}"

    @property
    def account(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{FULLNAME}"

    def helm(self, *args: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.cluster.helm), f"--kubeconfig={self.cluster.kubeconfig}", "-n", self.namespace, *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            env={**os.environ, **HELM_HOME},
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def get(self, *args: str) -> Any:
        """``kubectl get ... -o json``; None when not found."""
        proc = self.cluster.kubectl("get", *args, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise AssertionError(proc.stderr)
        return json.loads(proc.stdout)

    def can_i(self, verb: str, resource: str, namespace: str | None = None) -> bool:
        """``resource`` may name a subresource as ``omnimodels.omnimodel.io/status`` (kubectl would read
        the part after the slash as an object name)."""
        ns = ["-n", namespace] if namespace else []
        resource, _, sub = resource.partition("/")
        extra = [f"--subresource={sub}"] if sub else []
        proc = self.cluster.kubectl("auth", "can-i", verb, resource, *extra, f"--as={self.account}", *ns, check=False)
        answer = proc.stdout.strip()
        assert answer in ("yes", "no"), proc.stderr
        return answer == "yes"


def adopt_shared_crd(cluster: ClusterHandle, namespace: str) -> None:
    """Other suites install the CRD from crds/; let this release take it over instead of failing."""
    if cluster.kubectl("get", "crd", CRD, check=False).returncode != 0:
        return
    cluster.kubectl("label", "crd", CRD, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    cluster.kubectl(
        "annotate", "crd", CRD, f"meta.helm.sh/release-name={RELEASE}",
        f"meta.helm.sh/release-namespace={namespace}", "--overwrite",
    )  # fmt: skip


@pytest.fixture(scope="module")
def release(cluster: ClusterHandle) -> Iterator[Release]:
    suffix = uuid.uuid4().hex[:6]
    rel = Release(cluster, f"chart-e2e-{suffix}", f"chart-e2e-ml-{suffix}")
    for ns in (rel.namespace, rel.watched):
        cluster.kubectl("create", "namespace", ns)
    adopt_shared_crd(cluster, rel.namespace)
    try:
        out = rel.helm(
            "install", RELEASE, str(CHART), "--wait", "--timeout=120s",
            f"--set=watchNamespaces={{{rel.watched}}}",
        ).stdout  # fmt: skip
        # NOTES tell the user what to apply next, in the namespace the operator watches.
        assert f"kubectl apply -n {rel.watched} -f examples/text-tiny.yaml" in out
        yield rel
    finally:
        rel.helm("uninstall", RELEASE, "--wait", check=False)
        for ns in (rel.watched, rel.namespace):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_second_release_shares_the_crd_without_taking_it_over(release: Release) -> None:
    """Two operators in one cluster (say a team's namespace each): the second install succeeds, its
    RBAC covers its own namespaces, and the CRD stays with the first release."""
    suffix = uuid.uuid4().hex[:6]
    second = Release(release.cluster, f"chart-e2e-b-{suffix}", f"chart-e2e-ml-b-{suffix}")
    for ns in (second.namespace, second.watched):
        release.cluster.kubectl("create", "namespace", ns)
    try:
        out = second.helm(
            "install", RELEASE, str(CHART), "--wait", "--timeout=120s", f"--set=watchNamespaces={{{second.watched}}}"
        ).stdout
        assert "already exists under another owner" in out
        annotations = release.get("crd", CRD)["metadata"]["annotations"]
        assert annotations["meta.helm.sh/release-namespace"] == release.namespace
        assert second.can_i("patch", "deployments.apps", second.watched)
        assert not second.can_i("patch", "deployments.apps", release.watched)
        assert release.get("deployment", FULLNAME, "-n", second.namespace)["status"].get("availableReplicas") == 1
    finally:
        second.helm("uninstall", RELEASE, "--wait", check=False)
        for ns in (second.watched, second.namespace):
            release.cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    assert release.get("crd", CRD) is not None  # the second release's uninstall left it alone


def test_install_creates_the_operator_objects(release: Release) -> None:
    deployment = release.get("deployment", FULLNAME, "-n", release.namespace)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert deployment["status"].get("availableReplicas") == 1
    assert release.get("serviceaccount", FULLNAME, "-n", release.namespace) is not None
    assert release.get("clusterrole", release.cluster_role) is not None
    assert release.get("clusterrolebinding", release.cluster_role) is not None
    assert release.get("role", FULLNAME, "-n", release.watched) is not None
    assert release.get("rolebinding", FULLNAME, "-n", release.watched) is not None
    metrics = release.get("service", f"{FULLNAME}-metrics", "-n", release.namespace)
    assert metrics["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]
    crd = release.get("crd", CRD)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True"


NEEDED_IN_WATCHED = [
    ("list", "omnimodels.omnimodel.io"), ("watch", "omnimodels.omnimodel.io"),
    ("patch", "omnimodels.omnimodel.io/status"),
    ("create", "deployments.apps"), ("patch", "deployments.apps"), ("list", "deployments.apps"),
    ("watch", "deployments.apps"), ("get", "deployments.apps"), ("delete", "deployments.apps"),
    ("create", "configmaps"), ("patch", "services"), ("delete", "services"), ("create", "serviceaccounts"),
    ("watch", "serviceaccounts"), ("create", "horizontalpodautoscalers.autoscaling"),
    ("delete", "poddisruptionbudgets.policy"), ("patch", "networkpolicies.networking.k8s.io"),
    ("list", "pods"), ("watch", "pods"), ("create", "events"), ("patch", "deployments.apps/scale"),
    ("create", "jobs.batch"), ("watch", "jobs.batch"), ("delete", "jobs.batch"),  # weights fetch Jobs
    ("create", "persistentvolumeclaims"), ("watch", "persistentvolumeclaims"),  # model.cache claims
]  # fmt: skip
DENIED_IN_WATCHED = [
    ("get", "secrets"), ("list", "secrets"), ("watch", "secrets"),  # the gateway only names its key Secret
    ("create", "pods"), ("delete", "pods"), ("create", "pods/exec"), ("get", "pods"),
    ("delete", "omnimodels.omnimodel.io"), ("create", "omnimodels.omnimodel.io"),  # users own their CRs
    ("patch", "omnimodels.omnimodel.io"), ("get", "omnimodels.omnimodel.io"),  # status only; reads are watched
    ("update", "deployments.apps"),  # apply is a PATCH
    ("create", "serviceaccounts/token"), ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "cronjobs.batch"), ("list", "leases.coordination.k8s.io"), ("create", "persistentvolumes"),
]  # fmt: skip
DENIED_CLUSTER = [
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "clusterroles.rbac.authorization.k8s.io"), ("list", "nodes"), ("create", "namespaces"),
    ("create", "validatingwebhookconfigurations.admissionregistration.k8s.io"),
    ("create", "certificatesigningrequests.certificates.k8s.io"),
]  # fmt: skip


def test_rbac_allows_what_the_operator_needs_and_nothing_else(release: Release) -> None:
    for verb, resource in NEEDED_IN_WATCHED:
        assert release.can_i(verb, resource, release.watched), f"{verb} {resource} denied in {release.watched}"
    for verb, resource in DENIED_IN_WATCHED:
        assert not release.can_i(verb, resource, release.watched), f"{verb} {resource} allowed"
    # Namespaces it does not watch, its own included, are off limits.
    for ns in (release.namespace, "default"):
        assert not release.can_i("list", "omnimodels.omnimodel.io", ns)
        assert not release.can_i("create", "deployments.apps", ns)
    # kopf's cluster-scoped observers.
    for verb in ("list", "watch"):
        assert release.can_i(verb, "customresourcedefinitions.apiextensions.k8s.io")
        assert release.can_i(verb, "namespaces")
    for verb, resource in DENIED_CLUSTER:
        assert not release.can_i(verb, resource), f"{verb} {resource} allowed cluster-wide"


def operator_process(release: Release, workdir: Path) -> ChartOperator:
    """The operator container of the installed Deployment, run here with a token of the chart's
    ServiceAccount."""
    deployment = release.get("deployment", FULLNAME, "-n", release.namespace)
    token = release.cluster.kubectl(
        "create", "token", FULLNAME, "-n", release.namespace, "--duration=3600s"
    ).stdout.strip()
    kubeconfig = service_account_kubeconfig(release.cluster.kubeconfig, token, workdir / "sa.kubeconfig")
    return ChartOperator(deployment, kubeconfig, workdir)


def ready_condition(release: Release, name: str) -> dict[str, Any] | None:
    obj = release.get("omnimodel", name, "-n", release.watched)
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        ready = c["type"] == "Ready" and c["status"] == "True"
        if ready and c.get("observedGeneration") == obj["metadata"]["generation"]:
            return dict(c)
    return None


def test_operator_running_as_the_service_account_makes_an_example_ready(release: Release, tmp_path: Path) -> None:
    operator = operator_process(release, tmp_path)
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    try:
        assert json.loads(operator.env["OMNIMODEL_NAMESPACES"]) == [release.watched]
        wait_for(operator.healthy, 60, what="operator /healthz")
        release.cluster.kubectl("apply", "-n", release.watched, "-f", str(EXAMPLE))
        wait_for(lambda: ready_condition(release, name), 120, what=f"{name} Ready=True")

        log = operator.log.read_text()
        # This process did the work, with the chart's RBAC, and was never refused anything.
        assert f"Applied Deployment {release.watched}/{name}-gateway" in log, log[-4000:]
        assert "Forbidden" not in log and "Not enough permissions" not in log, log[-4000:]
        events = release.get("events", "-n", release.watched, f"--field-selector=involvedObject.name={name}")
        assert "Ready" in {e["reason"] for e in events["items"]}

        # Deleting the OmniModel while the operator runs lets kopf drop its finalizer.
        release.cluster.kubectl("delete", "-n", release.watched, "-f", str(EXAMPLE), "--wait=false")
        wait_for(lambda: release.get("omnimodel", name, "-n", release.watched) is None, 60, what=f"{name} deleted")
    finally:
        operator.stop()
        release.cluster.kubectl("delete", "-n", release.watched, "-f", str(EXAMPLE), "--wait=false", check=False)


def test_helm_test_hook_passes(release: Release) -> None:
    out = release.helm("test", RELEASE, "--timeout=120s").stdout
    assert "Phase:          Succeeded" in out or "Phase: Succeeded" in out, out


def test_upgrade_rolls_the_operator_and_can_switch_to_cluster_wide(release: Release) -> None:
    before = release.get("deployment", FULLNAME, "-n", release.namespace)
    release.helm(
        "upgrade", RELEASE, str(CHART), "--wait", "--timeout=120s",
        "--set=operator.resyncInterval=300", "--set=podAnnotations.rollout=second",
    )  # fmt: skip
    after = release.get("deployment", FULLNAME, "-n", release.namespace)
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    (container,) = after["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["OMNIMODEL_RESYNC_INTERVAL"] == "300"
    assert env["OMNIMODEL_NAMESPACES"] == "[]"
    assert after["spec"]["template"]["metadata"]["annotations"] == {"rollout": "second"}

    def rolled_out() -> bool:
        d = release.get("deployment", FULLNAME, "-n", release.namespace)
        s = d["status"]
        return bool(
            s.get("observedGeneration") == d["metadata"]["generation"]
            and s.get("updatedReplicas") == 1
            and s.get("availableReplicas") == 1
            and s.get("replicas") == 1
        )

    wait_for(rolled_out, 90, what="operator Deployment rolled out")
    # A new pod template: a new ReplicaSet now runs the single operator pod.
    selector = "app.kubernetes.io/instance=" + RELEASE
    sets = release.get("replicasets", "-n", release.namespace, "-l", selector)["items"]
    active = [rs for rs in sets if rs["spec"].get("replicas")]
    assert len(sets) == 2 and len(active) == 1, [(rs["metadata"]["name"], rs["spec"].get("replicas")) for rs in sets]

    # Cluster-wide now: the per-namespace Role is gone, the ClusterRole carries the rules.
    assert release.get("role", FULLNAME, "-n", release.watched) is None
    assert release.can_i("list", "omnimodels.omnimodel.io", "default")
    assert release.can_i("patch", "deployments.apps", release.namespace)
    assert not release.can_i("get", "secrets", "default")
    assert not release.can_i("list", "namespaces")  # kopf does not observe namespaces cluster-wide


def test_uninstall_keeps_the_crd(release: Release) -> None:
    release.helm("uninstall", RELEASE, "--wait", "--timeout=120s")
    assert release.get("deployment", FULLNAME, "-n", release.namespace) is None
    assert release.get("clusterrole", release.cluster_role) is None
    assert release.get("serviceaccount", FULLNAME, "-n", release.namespace) is None
    assert release.get("crd", CRD) is not None
