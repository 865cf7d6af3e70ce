"""The operator logged in the way EKS, GKE and AKS users log in from outside a cluster: a kubeconfig
whose user is an exec credential plugin. It reconciles an OmniModel, and keeps reconciling after the
token it holds is revoked.

The plugin is a shell script that asks the API server for a ServiceAccount token (TokenRequest, as
``kubectl create token``) bound to a Secret named in a file. Deleting that Secret revokes every token
bound to it at once, which is how the test rotates credentials for real (a TokenRequest's
``expirationSeconds`` cannot go below 600 s): the test binds new tokens to a new Secret, deletes the
old one, waits until the API server refuses the old token, and changes the OmniModel. The operator's
next write is refused (401), lightkube runs the plugin again, and the change lands.

The session's operator (admin kubeconfig, cluster-wide) is paused meanwhile (SIGSTOP, resumed in
``finally``): otherwise it could make the writes this test must see the exec-plugin operator make.
About 25 s: the operator's start, two passes, and up to 10 s of the API server's token cache.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnimodel_testbed.operator_process import service_account_kubeconfig
from omnimodel_testbed.pytest_plugin import ClusterHandle, kubectl_binary
from support import Kube, Operator, example, wait_for

ACCOUNT = "omnimodel-exec-auth"


def exec_kubeconfig(cluster: ClusterHandle, plugin: Path, path: Path) -> Path:
    """The admin kubeconfig's cluster (server and CA) with a user that only has the exec plugin."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    server = next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"]
    if ca := server.get("certificate-authority"):
        server = {**server, "certificate-authority": str(cluster.kubeconfig.parent / ca)}
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": str(plugin)}}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "testbed", "cluster": server}],
                "users": [{"name": "exec", "user": user}],
                "contexts": [{"name": "exec", "context": {"cluster": "testbed", "user": "exec"}}],
                "current-context": "exec",
            }
        )
    )
    return path


def credential_plugin(cluster: ClusterHandle, namespace: str, binding: Path, issued: Path, path: Path) -> Path:
    """A plugin that prints an ExecCredential with a fresh token of ``ACCOUNT`` bound to the Secret named
    in ``binding``, and appends ``<secret> <token>`` to ``issued`` on every run."""
    path.write_text(
        "#!/bin/sh\nset -e\n"
        f'secret=$(cat "{binding}")\n'
        f'token=$("{kubectl_binary()}" --kubeconfig="{cluster.kubeconfig}" -n {namespace} create token {ACCOUNT} '
        '--bound-object-kind=Secret --bound-object-name="$secret" --duration=1h)\n'
        f'echo "$secret $token" >> "{issued}"\n'
        'printf \'{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential",'
        '"status":{"token":"%s"}}\' "$token"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def paused_session_operator(operator: Operator) -> Iterator[None]:
    assert operator.proc is not None and operator.proc.poll() is None
    os.kill(operator.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(operator.proc.pid, signal.SIGCONT)


def applied(log: Path, ref: str) -> int:
    return log.read_text(errors="replace").count(f"Applied Deployment {ref}")


def status_for_generation(kube: Kube, name: str) -> dict[str, Any] | None:
    obj = kube.get("omnimodel", name)
    gen = obj["metadata"]["generation"]
    ready = next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None)
    return ready if ready is not None and ready.get("observedGeneration") == gen else None


def test_exec_plugin_credentials_reconcile_and_survive_a_revoked_token(
    cluster: ClusterHandle, crd: None, paused_session_operator: None, tmp_path: Path
) -> None:
    ns = f"e2e-auth-{uuid.uuid4().hex[:8]}"
    binding_name = f"{ns}-{ACCOUNT}"
    cluster.kubectl("create", "namespace", ns)
    kube = Kube(cluster, ns)
    operator: Operator | None = None
    try:
        kube.run("create", "serviceaccount", ACCOUNT)
        # The operator's RBAC is the chart's business (test_chart); here, only how it logs in.
        cluster.kubectl(
            "create",
            "clusterrolebinding",
            binding_name,
            "--clusterrole=cluster-admin",
            f"--serviceaccount={ns}:{ACCOUNT}",
        )
        kube.run("create", "secret", "generic", "binding-1")
        binding, issued = tmp_path / "binding", tmp_path / "issued"
        binding.write_text("binding-1")
        plugin = credential_plugin(cluster, ns, binding, issued, tmp_path / "credential-plugin")
        config = exec_kubeconfig(cluster, plugin, tmp_path / "exec.kubeconfig")

        operator = Operator(
            cluster, tmp_path, env={"KUBECONFIG": str(config), "OMNIMODEL_NAMESPACES": json.dumps([ns])}
        )
        operator.start()  # /healthz: preflight listed OmniModels and kopf logged in, both through the plugin
        log = tmp_path / "operator-1.log"
        kube.apply(example("text-tiny.yaml"))
        wait_for(lambda: status_for_generation(kube, "text-tiny"), 30, what="status for generation 1")
        assert applied(log, f"{ns}/text-tiny-llm") == 1, log.read_text()[-4000:]
        first_tokens = [line.split()[1] for line in issued.read_text().splitlines()]
        assert first_tokens, "the plugin never ran"

        # Rotate: new tokens are bound to binding-2; deleting binding-1 revokes every earlier one.
        kube.run("create", "secret", "generic", "binding-2")
        binding.write_text("binding-2")
        kube.run("delete", "secret", "binding-1")

        old = service_account_kubeconfig(cluster.kubeconfig, first_tokens[-1], tmp_path / "old.kubeconfig")

        def revoked() -> bool:
            # The API server caches a token's successful authentication for up to 10 s.
            probe = subprocess.run(
                [kubectl_binary(), f"--kubeconfig={old}", "get", "--raw=/api"],
                capture_output=True,
                text=True,
                check=False,
            )
            return "Unauthorized" in probe.stderr

        wait_for(revoked, 20, interval=0.5, what="the first token refused")

        kube.run(
            "patch",
            "omnimodel",
            "text-tiny",
            "--type=json",
            "-p",
            '[{"op":"add","path":"/spec/stages/0/replicas","value":2}]',
        )
        wait_for(
            lambda: kube.get("deployment", "text-tiny-llm")["spec"]["replicas"] == 2, 30, what="replicas 2 applied"
        )
        wait_for(lambda: status_for_generation(kube, "text-tiny"), 30, what="status for generation 2")
        assert applied(log, f"{ns}/text-tiny-llm") == 2, log.read_text()[-4000:]
        # The plugin ran again, for binding-2, once the old token was refused.
        assert issued.read_text().splitlines()[-1].startswith("binding-2 ")
    finally:
        if operator is not None:
            operator.stop()
        cluster.kubectl("delete", "clusterrolebinding", binding_name, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
