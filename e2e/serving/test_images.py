"""What a kubelet runs is our images: the test bed's pods run from the images `make images` pushed to its
registry, as the images' user, inside the images' root filesystems; a missing image is what a user sees
in status. (Break it by hand: a pod runner without an image store runs every command from the venv,
and the first test fails on the pods' empty imageID and the host's root.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import openai

from omnimodel_testbed.kubelet import PodRunner
from omnimodel_testbed.operator_pod import RELEASE_NAMESPACE, OperatorPod
from omnimodel_testbed.pytest_plugin import ClusterHandle
from omnimodel_testbed.registry import RegistryImages
from support import Kube, example, healthy, wait_for


def _registry_digest(reference: str) -> str:
    """The manifest digest the test bed's registry serves for ``reference`` (skopeo, as a user would check)."""
    out = subprocess.run(
        ["skopeo", "inspect", "--tls-verify=false", f"docker://{reference}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return str(json.loads(out)["Digest"])


def _uids(pid: int) -> tuple[int, int]:
    """(real uid, real gid) of a process, from the kernel."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Uid"].split()[0]), int(fields["Gid"].split()[0])


def _pods(cluster: ClusterHandle, namespace: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def test_every_pod_and_the_operator_run_their_images_as_uid_1000(
    cluster: ClusterHandle, kube: Kube, pods: PodRunner, operator: OperatorPod
) -> None:
    assert cluster.state is not None
    images = RegistryImages.of(cluster.state)
    kube.apply(example("text-tiny.yaml"))
    kube.wait_ready("text-tiny", timeout=300)
    base = f"http://text-tiny-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: healthy(base), 180, interval=0.5, what="gateway /health 200")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].message.content

    runtime, operator_image = images.runtime("cpu"), images.operator
    expected = {
        runtime: f"{runtime.rsplit(':', 1)[0]}@{_registry_digest(runtime)}",
        operator_image: f"{operator_image.rsplit(':', 1)[0]}@{_registry_digest(operator_image)}",
    }
    seen = {}
    for pod in [*_pods(cluster, kube.ns), *_pods(cluster, RELEASE_NAMESPACE)]:
        for status in pod["status"]["containerStatuses"]:
            seen[pod["metadata"]["name"]] = (status["image"], status["imageID"])
    assert len(seen) == 3, seen  # gateway, stage, operator
    for name, (image, image_id) in seen.items():
        assert image in expected, f"{name} runs {image}, not an image of the test bed's registry"
        assert image_id == expected[image], f"{name}: imageID {image_id!r}, registry digest {expected[image]}"

    processes = [*pods.processes("text-tiny-"), operator.process()]
    assert len(processes) == 3
    for process in processes:
        assert process is not None
        root = os.readlink(f"/proc/{process.proc.pid}/root")
        assert root != "/", f"{process.name} runs with the host's root filesystem as its root"
        assert Path(f"/proc/{process.proc.pid}/root/opt/omnimodel/bin/omnimodel-operator").is_file(), process.name
        assert _uids(process.proc.pid) == (1000, 1000), f"{process.name} is not the image's user 1000"


_PROBE = """
import errno, json, os
result = {"uid": os.getuid(), "gid": os.getgid()}
for path in ("/x", "/opt/omnimodel/x", "/tmp/x", "/dev/shm/x"):
    try:
        with open(path, "w") as f:
            f.write("x")
        result[path] = "written"
    except OSError as exc:
        result[path] = errno.errorcode[exc.errno]
with open("/dev/termination-log", "w") as f:
    json.dump(result, f)
"""


def _probe_pod(name: str, image: str, *, read_only: bool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "fsGroup": 1000},
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "command": ["python", "-c", _PROBE],
                    "securityContext": {"readOnlyRootFilesystem": read_only, "allowPrivilegeEscalation": False},
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }


def test_uid_1000_and_a_read_only_root_filesystem(cluster: ClusterHandle, kube: Kube, pods: PodRunner) -> None:
    assert cluster.state is not None
    image = RegistryImages.of(cluster.state).runtime("cpu")
    kube.apply(_probe_pod("ro", image, read_only=True))
    kube.apply(_probe_pod("rw", image, read_only=False))

    def finished(name: str) -> dict[str, Any] | None:
        pod = kube.get("pod", name)
        statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
        terminated = (statuses[0].get("state") or {}).get("terminated") if statuses else None
        return terminated if terminated else None

    ro = wait_for(lambda: finished("ro"), 300, what="the read-only pod finished")
    rw = wait_for(lambda: finished("rw"), 120, what="the writable pod finished")
    assert ro["exitCode"] == 0, ro
    read_only, writable = json.loads(ro["message"]), json.loads(rw["message"])
    # The image's USER 1000:1000 (the pod names no runAsUser), and only its volumes and /dev/shm writable.
    assert read_only == {
        "uid": 1000, "gid": 1000, "/x": "EROFS", "/opt/omnimodel/x": "EROFS", "/tmp/x": "written",
        "/dev/shm/x": "written",
    }  # fmt: skip
    # Without readOnlyRootFilesystem the root is writable, but not by uid 1000 where the image's files are root's.
    assert writable == {
        "uid": 1000, "gid": 1000, "/x": "EACCES", "/opt/omnimodel/x": "EACCES", "/tmp/x": "written",
        "/dev/shm/x": "written",
    }  # fmt: skip


def test_a_missing_image_makes_the_omnimodel_not_ready_naming_it(
    cluster: ClusterHandle, kube: Kube, pods: PodRunner
) -> None:
    """The kubelet (the pod runner) fails the pull; the operator's status says so with its words."""
    assert cluster.state is not None
    missing = f"{RegistryImages.of(cluster.state).prefix}/omnimodel-runtime:does-not-exist"
    doc = example("text-tiny.yaml")
    doc["spec"]["runtime"] = {"image": missing}
    kube.apply(doc)

    def not_ready_naming_image() -> dict[str, Any] | None:
        c = kube.condition("text-tiny")
        if c and c["status"] == "False" and missing in c.get("message", "") and "ImagePull" in c.get("message", ""):
            return c
        return None

    condition = wait_for(not_ready_naming_image, 120, what="Ready=False naming the missing image")
    assert "manifest unknown" in condition["message"] or "not found" in condition["message"], condition
