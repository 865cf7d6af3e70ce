"""The operator's Helm chart on the local control plane: install, RBAC, the operator pod reconciling,
kopf peering between two operators, `helm test`, a rolling upgrade, uninstall.

The release namespace is served by the test bed's kubelet (omnimodel_testbed.kubelet), so the chart's
operator pod and its `helm test` pod run from the operator image that `make images` pushed to the test
bed's registry, with the projected token of their ServiceAccounts: every API call goes through the
chart's RBAC, and with the chart's probes run (the operator pod is Ready once kopf's /healthz answers).
The pods of the OmniModels in the watched namespace are kwok's.

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
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnimodel_testbed import Cluster
from omnimodel_testbed.binaries import kubectl_binary
from omnimodel_testbed.kubelet import PodProcess, PodRunner
from omnimodel_testbed.operator_pod import HEALTH_PORT, METRICS_PORT, image_store, service_env
from omnimodel_testbed.operator_process import ChartOperator, service_account_kubeconfig
from omnimodel_testbed.pytest_plugin import ClusterHandle
from omnimodel_testbed.registry import RegistryImages
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
    runner: PodRunner | None = None  # plays the release namespace's pods, from their images

    def operator_pods(self) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
        return list(self.get("pods", "-n", self.namespace, "-l", selector)["items"])

    def operator_process(self, pod: str) -> PodProcess | None:
        """The running container process of operator pod ``pod``, if it is running."""
        assert self.runner is not None
        found = [p for p in self.runner.processes(pod) if p.name == pod]
        return found[0] if found else None

    def serving_operators(self) -> list[str]:
        """Operator pods the API server calls Ready, not being deleted, whose container runs here."""
        ready = []
        for pod in self.operator_pods():
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
            process = self.operator_process(pod["metadata"]["name"])
            running = process is not None and process.proc.poll() is None
            deleted = bool(pod["metadata"].get("deletionTimestamp"))
            if conditions.get("Ready") == "True" and running and not deleted:
                ready.append(pod["metadata"]["name"])
        return ready

    def operator_log(self) -> str:
        """The log of the one operator pod running now."""
        (name,) = self.serving_operators()
        process = self.operator_process(name)
        assert process is not None
        return process.log_path.read_text(errors="replace")[process.log_offset :]

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


def image_values(cluster: ClusterHandle) -> list[str]:
    """The chart pointed at the images in the test bed's registry; the operator's ports as
    omnimodel_testbed.operator_pod has them (the test bed's pods share one network namespace)."""
    assert cluster.state is not None
    return [
        *RegistryImages.of(cluster.state).chart_values(),
        f"--set=operator.healthPort={HEALTH_PORT}",
        f"--set=metrics.port={METRICS_PORT}",
    ]


@pytest.fixture(scope="module")
def release(cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    assert cluster.state is not None, "the chart's pods run on the test bed's kubelet"
    suffix = uuid.uuid4().hex[:6]
    namespace = f"chart-e2e-{suffix}"
    runner = PodRunner(
        Cluster().api(cluster.state),
        namespace,
        tmp_path_factory.mktemp("chart-pods"),
        Path(sys.executable).parent,
        images=image_store(cluster.state),
        service_env=service_env(cluster.state),
    )
    rel = Release(cluster, namespace, f"chart-e2e-ml-{suffix}", runner)
    for ns in (rel.namespace, rel.watched):
        cluster.kubectl("create", "namespace", ns)
    adopt_shared_crd(cluster, rel.namespace)
    runner.start()  # before the install: the kubelet plays only pods created while it serves
    try:
        out = rel.helm(
            "install", RELEASE, str(CHART), "--wait", "--timeout=120s",
            f"--set=watchNamespaces={{{rel.watched}}}", *image_values(cluster),
        ).stdout  # fmt: skip
        # NOTES tell the user what to apply next, in the namespace the operator watches.
        assert f"kubectl apply -n {rel.watched} -f examples/text-tiny.yaml" in out
        wait_for(rel.serving_operators, 120, what="the operator pod running from its image")
        yield rel
    finally:
        rel.helm("uninstall", RELEASE, "--wait", check=False)
        runner.stop()
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
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert release.get("kopfpeering", release.cluster_role, "-n", release.watched) is not None
    assert deployment["status"].get("availableReplicas") == 1
    assert release.get("serviceaccount", FULLNAME, "-n", release.namespace) is not None
    assert release.get("clusterrole", release.cluster_role) is not None
    assert release.get("clusterrolebinding", release.cluster_role) is not None
    assert release.get("role", FULLNAME, "-n", release.watched) is not None
    assert release.get("rolebinding", FULLNAME, "-n", release.watched) is not None
    metrics = release.get("service", f"{FULLNAME}-metrics", "-n", release.namespace)
    assert metrics["spec"]["ports"] == [
        {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
    ]
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
    ("list", "kopfpeerings.kopf.dev"), ("watch", "kopfpeerings.kopf.dev"),  # kopf peering
    ("create", "persistentvolumeclaims"), ("watch", "persistentvolumeclaims"),  # model.cache claims
    ("get", "secrets"),  # a Secret the spec names, read by name to report it missing
]  # fmt: skip
DENIED_IN_WATCHED = [
    ("list", "secrets"), ("watch", "secrets"),  # Secrets only by name: their data never streams in
    ("create", "pods"), ("delete", "pods"), ("create", "pods/exec"), ("get", "pods"),
    ("delete", "omnimodels.omnimodel.io"), ("create", "omnimodels.omnimodel.io"),  # users own their CRs
    ("patch", "omnimodels.omnimodel.io"), ("get", "omnimodels.omnimodel.io"),  # status only; reads are watched
    ("update", "deployments.apps"),  # apply is a PATCH
    ("create", "serviceaccounts/token"), ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "cronjobs.batch"), ("list", "leases.coordination.k8s.io"), ("create", "persistentvolumes"),
    ("create", "kopfpeerings.kopf.dev"), ("patch", "kopfpeerings.kopf.dev"),  # only its own peering object
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


def test_the_operator_pod_pauses_while_a_second_operator_of_the_release_runs(release: Release, tmp_path: Path) -> None:
    """kopf peering, as during a rolling upgrade: a second operator of the release (the pod's command,
    run here with a token of the chart's ServiceAccount) makes both pause, so neither reconciles an
    OmniModel applied meanwhile; once it exits, the pod resumes and makes the example Ready through the
    chart's RBAC (its projected token) without being refused anything."""
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    second = operator_process(release, tmp_path)
    try:
        wait_for(second.healthy, 60, what="second operator /healthz")
        # kopf starts an operator paused until its first peering event; the second stays so, and the
        # pod, which was running, pauses when the second announces itself.
        wait_for(lambda: "Possibly conflicting operators" in second.log.read_text(), 30, what="second sees the pod")
        wait_for(lambda: "Pausing all operators" in release.operator_log(), 30, what="operator pod paused")
        release.cluster.kubectl("apply", "-n", release.watched, "-f", str(EXAMPLE))
        # A bounded look for what must not happen: any status or child within 5 s would be a double act.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert not (release.get("omnimodel", name, "-n", release.watched) or {}).get("status")
            assert release.get("deployment", f"{name}-gateway", "-n", release.watched) is None
        second_log = second.log.read_text()
        assert "Applied" not in second_log and "Resuming operations" not in second_log, second_log[-4000:]
    finally:
        second.stop()
    try:
        wait_for(lambda: "Resuming operations" in release.operator_log(), 60, what="operator pod resumed")
        wait_for(lambda: ready_condition(release, name), 120, what=f"{name} Ready=True")
        log = release.operator_log()
        assert f"Applied Deployment {release.watched}/{name}-gateway" in log, log[-4000:]
        assert "Forbidden" not in log and "Not enough permissions" not in log, log[-4000:]
        events = release.get("events", "-n", release.watched, f"--field-selector=involvedObject.name={name}")
        assert "Ready" in {e["reason"] for e in events["items"]}
        # Deleting the OmniModel needs no operator (no finalizer).
        release.cluster.kubectl("delete", "-n", release.watched, "-f", str(EXAMPLE), "--wait=false")
        wait_for(lambda: release.get("omnimodel", name, "-n", release.watched) is None, 60, what=f"{name} deleted")
    finally:
        release.cluster.kubectl("delete", "-n", release.watched, "-f", str(EXAMPLE), "--wait=false", check=False)


def test_helm_test_proves_the_operator_reconciles(release: Release) -> None:
    """The hook Job runs from the operator image here, creates its OmniModel in the watched namespace,
    waits for the operator pod's status and Deployments, deletes it."""
    out = release.helm("test", RELEASE, "--timeout=150s").stdout
    assert "Phase:          Succeeded" in out or "Phase: Succeeded" in out, out
    # What the Job's pod printed (Helm deleted the Job on success; the kubelet's log stays).
    assert release.runner is not None
    (log,) = release.runner.workdir.glob(f"{FULLNAME}-test-*/*.log")
    text = log.read_text()
    assert "the operator reconciled it: Ready=" in text and f"Deployments {RELEASE}-helm-test-" in text, text
    assert release.get("omnimodel", f"{RELEASE}-helm-test", "-n", release.watched) is None
    # Its account and RBAC went with it (hook-succeeded).
    assert release.get("role", f"{FULLNAME}-test", "-n", release.watched) is None


@contextmanager
def operator_pod_watch(release: Release) -> Iterator[list[dict[str, Any]]]:
    """A watch of the release's operator pods (``kubectl get --watch``) for as long as the block runs;
    the list it yields holds the watch's events, in the API server's order, once the block has left."""
    selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
    watch = subprocess.Popen(
        [
            kubectl_binary(), f"--kubeconfig={release.cluster.kubeconfig}", "get", "pods", "-n", release.namespace,
            "-l", selector, "--watch", "--output-watch-events", "-o", "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    events: list[dict[str, Any]] = []
    try:
        yield events
    finally:
        watch.terminate()
        text, _ = watch.communicate(timeout=30)
    decoder, at = json.JSONDecoder(), 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        try:
            event, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            # The watch was stopped mid-write: only its last event can be cut short, and the block waited
            # for every event it looks at before it left.
            assert "\n{" not in text[at:], text[at : at + 2000]
            break
        events.append(event)


def serving_throughout(events: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """Replay a pod watch: after each event, how many operator pods were Ready and not being deleted.
    Returns (event type, pod, count) per event; the API server orders the events of one watch."""
    serving: dict[str, bool] = {}
    out = []
    for event in events:
        pod = event["object"]
        name = pod["metadata"]["name"]
        conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
        alive = event["type"] != "DELETED" and not pod["metadata"].get("deletionTimestamp")
        serving[name] = alive and conditions.get("Ready") == "True"
        out.append((event["type"], name, sum(serving.values())))
    return out


def test_upgrade_keeps_an_operator_serving_throughout(release: Release) -> None:
    """`helm upgrade` with new operator values (a new pod template; not a new image reference, which
    the test bed's kubelet would pull and unpack again, a minute or more here). Watched through the
    rollout, some operator pod is
    Ready and not being deleted after every change to the pods: the new pod is Ready before the old
    one is marked for deletion (a Recreate rollout deletes the old pod first, and fails this). Then
    the new pod reconciles."""
    (old,) = release.serving_operators()
    with operator_pod_watch(release) as events:
        release.helm(
            "upgrade", RELEASE, str(CHART), "--wait", "--timeout=120s",
            f"--set=watchNamespaces={{{release.watched}}}", *image_values(release.cluster),
            "--set=operator.workers=2", "--set=podAnnotations.rollout=rolling",
        )  # fmt: skip
        wait_for(lambda: (s := release.serving_operators()) and old not in s, 90, what="the new operator pod alone")
        (new,) = release.serving_operators()
        # The old pod's deletion has reached the API server; let the watch deliver it, then stop it.
        wait_for(lambda: release.operator_process(old) is None, 60, what="the old operator pod stopped")
    replay = serving_throughout(events)
    assert {name for _, name, _ in replay} >= {old, new}, replay
    assert all(count >= 1 for _, _, count in replay), replay
    assert new != old
    deployment = release.get("deployment", FULLNAME, "-n", release.namespace)
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {"name": "OMNIMODEL_WORKERS", "value": "2"} in container["env"]

    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    try:
        release.cluster.kubectl("apply", "-n", release.watched, "-f", str(EXAMPLE))
        wait_for(lambda: ready_condition(release, name), 120, what=f"{name} Ready=True after the upgrade")
        assert f"Applied Deployment {release.watched}/{name}-gateway" in release.operator_log()
    finally:
        release.cluster.kubectl("delete", "-n", release.watched, "-f", str(EXAMPLE), "--wait=false", check=False)


#: The longest a Recreate rollout of the operator may leave the cluster without an operator pod: the old
#: pod's stop (kopf's exit, with omnimodel_operator.cli.EXIT_ERROR_BACKOFFS), then the deployment
#: controller's new pod. Well under the chart's 30 s grace period, which an operator retrying a refused
#: call on its way out would use up.
RECREATE_GAP_MAX = 15.0


def no_operator_after_stop(events: list[dict[str, Any]], old: str, new: dict[str, Any]) -> float:
    """Seconds from the request to stop operator pod ``old`` (its deletionTimestamp less its grace period,
    as a pod watch saw it) to the creation of the ``new`` pod, both by the API server's clock."""
    stopping = next(
        e["object"]["metadata"]
        for e in events
        if e["object"]["metadata"]["name"] == old and e["object"]["metadata"].get("deletionTimestamp")
    )
    requested = timestamp(stopping["deletionTimestamp"]) - float(stopping["deletionGracePeriodSeconds"])
    return timestamp(new["metadata"]["creationTimestamp"]) - requested


def timestamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_upgrade_rolls_the_operator_and_can_switch_to_cluster_wide(release: Release) -> None:
    """`helm upgrade` from watchNamespaces to cluster-wide: a Recreate rollout, so the old pod must stop
    promptly although the same upgrade took away its Role (and with it the right to leave its peering
    object); then the new pod runs on the ClusterRole alone."""
    (old,) = release.serving_operators()
    before = release.get("deployment", FULLNAME, "-n", release.namespace)
    with operator_pod_watch(release) as events:
        release.helm(
            "upgrade", RELEASE, str(CHART), "--wait", "--timeout=120s", *image_values(release.cluster),
            "--set=operator.resyncInterval=300", "--set=podAnnotations.rollout=second",
        )  # fmt: skip
        # helm --wait returned with the new pod Ready: the old one is gone (Recreate) and the watch
        # delivered its stop request seconds ago.
        (pod,) = release.operator_pods()
    assert pod["metadata"]["name"] != old
    gap = no_operator_after_stop(events, old, pod)
    assert gap <= RECREATE_GAP_MAX, f"no operator pod for {gap:.0f} s after the old one was asked to stop"
    after = release.get("deployment", FULLNAME, "-n", release.namespace)
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    # The running pod announces itself in the watched namespace's KopfPeering, the new one would in a
    # ClusterKopfPeering: they could not see each other, so this one rollout is Recreate.
    assert after["spec"]["strategy"]["type"] == "Recreate"
    (container,) = after["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
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
    assert len(active) == 1, [(rs["metadata"]["name"], rs["spec"].get("replicas")) for rs in sets]
    assert active[0]["metadata"]["creationTimestamp"] >= after["metadata"]["creationTimestamp"]
    wait_for(lambda: len(release.serving_operators()) == 1, 90, what="the cluster-wide operator pod")
    assert release.get("clusterkopfpeering", release.cluster_role) is not None

    # Cluster-wide now: the per-namespace Role is gone, the ClusterRole carries the rules.
    assert release.get("role", FULLNAME, "-n", release.watched) is None
    assert release.can_i("list", "omnimodels.omnimodel.io", "default")
    assert release.can_i("patch", "deployments.apps", release.namespace)
    assert release.can_i("get", "secrets", "default")  # by name, to report one an OmniModel lacks
    assert not release.can_i("list", "secrets", "default")
    assert not release.can_i("list", "namespaces")  # kopf does not observe namespaces cluster-wide


def test_uninstall_keeps_the_crd(release: Release) -> None:
    release.helm("uninstall", RELEASE, "--wait", "--timeout=120s")
    assert release.get("deployment", FULLNAME, "-n", release.namespace) is None
    assert release.get("clusterrole", release.cluster_role) is None
    assert release.get("serviceaccount", FULLNAME, "-n", release.namespace) is None
    assert release.get("crd", CRD) is not None
