"""hf:// weights on a cluster, for real: the operator's one fetch Job downloads from the test bed's Hugging
Face mirror (olah on loopback, real ``huggingface_hub`` in ``omnimodel fetch``) into a claim; the real Job
controller sees the pod the pod runner ran succeed or fail; stage pods wait for the weights in an init
container, mount the claim read-only and load only their own files; the official openai client gets an
image through the gateway. The mirror's access log is the record of every request and byte sent.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from omnimodel_runtime.fetch.cache import VIEW_MARKER, Marker, read_marker
from omnimodel_runtime.pipeline import ModelSource, get_preset, select_files
from omnimodel_runtime.tiny import ensure_tiny
from omnimodel_testbed.hfmirror import HubMirror
from omnimodel_testbed.kubelet import PodProcess, PodRunner
from support import Kube, healthy, wait_for

# Up to seven torch processes (three stages, the gateway, two more decode replicas, the fetch) on a small host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).parents[2]
MODEL_CACHE = Path.home() / ".cache" / "omnimodel" / "models"
HF_REPO = "acme/tiny-t2i"
GOOD_TOKEN, BAD_TOKEN = "hf_testbed_good", "hf_testbed_wrong"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
STAGE = "omnimodel.io/stage"
# What the fetch container mounts the claim as and points huggingface_hub at (operator builders/weights.py).
HUB_CACHE_IN_CLAIM = Path("hf/hub")
# Files every text-to-image stage reads besides its own folder (docs/weights.md).
SHARED_CONFIGS = ("model_index.json", "transformer/config.json", "vae/config.json")


@dataclass(frozen=True)
class Published:
    mirror: HubMirror
    sha: str


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    """The tiny Qwen-Image-like model the runtime builds, published as a private repository."""
    model = ensure_tiny("text-to-image", MODEL_CACHE)
    hub = HubMirror(tmp_path_factory.mktemp("hfmirror") / "mirror", host="127.0.0.6").start()
    try:
        sha = hub.publish(model, HF_REPO)
        hub.require_token(HF_REPO, GOOD_TOKEN)
        yield Published(hub, sha)
    finally:
        hub.stop()


def omnimodel(name: str, mirror: HubMirror, cache: dict[str, Any]) -> dict[str, Any]:
    """The tiny text-to-image example, its model from the mirror with a cache and the token Secret."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "text-to-image-tiny.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["model"] = {
        "source": f"hf://{HF_REPO}",
        "endpoint": mirror.url,
        "cache": cache,
        "tokenSecret": {"name": "hf-token"},
    }
    return doc


def token_secret(token: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"}, "stringData": {"token": token}}


def condition(kube: Kube, name: str, type_: str) -> dict[str, Any]:
    obj = kube.get("omnimodel", name) or {}
    found = [c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_]
    return found[0] if found else {}


def stage_files(mirror: HubMirror, stage: str) -> dict[str, int]:
    """What ``stage`` needs of the repository: the preset's file set over the mirror's own listing."""
    listing = mirror.files(HF_REPO)
    pipeline = get_preset("text-to-image").pipeline(ModelSource(source=f"hf://{HF_REPO}"))
    return {path: listing[path] for path in select_files(pipeline.stage(stage).files, listing, None)}


def fetch_jobs(kube: Kube, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kube.get("jobs", selector=f"{INSTANCE}={name},{COMPONENT}=fetch")["items"]
    return items


def job_condition(job: dict[str, Any], type_: str) -> dict[str, Any]:
    found = [c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == type_]
    return found[0] if found and found[0]["status"] == "True" else {}


def read_only_mounts(pid: int) -> dict[str, str]:
    """Read-only mounts in the mount namespace of process ``pid``: the directory mounted (its path on this
    machine's filesystem) → where the process sees it (inside its container)."""
    out = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if "ro" in fields[5].split(","):
            out[fields[3]] = fields[4]
    return out


def view_of(proc: PodProcess) -> dict[str, Any]:
    """The view (a directory of symlinks) the stage process loaded its model from, in its pod's /tmp.
    Waited for, should a caller look before the stage has loaded it (before its pod is Ready)."""
    views = proc.log_path.parent / "volumes" / "tmp" / "omnimodel-views"
    (marker,) = wait_for(lambda: list(views.glob(f"*/{VIEW_MARKER}")), 120, what=f"{proc.name}'s model view")
    view: dict[str, Any] = json.loads(marker.read_text())
    view["dir"] = marker.parent
    return view


def test_one_fetch_job_fills_the_claim_and_each_stage_reads_only_its_share(
    kube: Kube, pods: PodRunner, published: Published
) -> None:
    mirror, sha = published.mirror, published.sha
    name = "t2i-hf"
    claim = f"{name}-models"
    kube.apply(token_secret(GOOD_TOKEN))
    mark = mirror.log_mark()
    # No provisioner here: the pod runner binds the claim the operator creates to a directory of its own.
    kube.apply(omnimodel(name, mirror, {"storageClassName": "testbed-rwx", "size": "1Gi"}))
    kube.wait_ready(name, timeout=300)

    # 1. ONE fetch Job, `omnimodel fetch`, that the real Job controller saw succeed with its one pod.
    (job,) = fetch_jobs(kube, name)
    assert job["metadata"]["name"].startswith(f"{name}-fetch-")
    assert job_condition(job, "Complete"), job["status"]
    assert (job["status"].get("succeeded"), job["status"].get("failed")) == (1, None)
    (fetch,) = job["spec"]["template"]["spec"]["containers"]
    assert fetch["command"] == ["omnimodel", "fetch"]
    (fetch_pod,) = kube.pods(f"{INSTANCE}={name},{COMPONENT}=fetch")
    assert fetch_pod["status"]["phase"] == "Succeeded"
    (state,) = [s["state"]["terminated"] for s in fetch_pod["status"]["containerStatuses"]]
    assert state["exitCode"] == 0 and state["message"].startswith(f"Complete: {HF_REPO}@"), state

    # WeightsReady from that Job, status.weights from its termination message.
    weights_ready = condition(kube, name, "WeightsReady")
    assert (weights_ready["status"], weights_ready["reason"]) == ("True", "Complete"), weights_ready
    weights = kube.get("omnimodel", name)["status"]["weights"]
    union: dict[str, int] = {}
    for stage in ("encode", "denoise", "decode"):
        union |= stage_files(mirror, stage)
    assert weights["state"] == "Complete"
    assert (weights["job"], weights["revision"], weights["sha"]) == (job["metadata"]["name"], "main", sha)
    assert weights["filesDone"] == weights["filesTotal"] == len(union)
    assert weights["bytesDone"] == weights["bytesTotal"] == sum(union.values())

    # The mirror sent each file the stages need once, to a request with the good token, and nothing else.
    assert mirror.downloads(mark, HF_REPO) == union
    assert {e.token for e in mirror.access_log(mark) if e.repo == HF_REPO} == {"valid"}

    # Stage pods: the claim read-only, an init container that waited for the weights, no token anywhere.
    stage_pods = kube.pods(f"{INSTANCE}={name},{COMPONENT} in (stage,gateway)")
    assert len(stage_pods) == 4, [p["metadata"]["name"] for p in stage_pods]  # three stages and the gateway
    for pod in stage_pods:
        spec = pod["spec"]
        envs = [e["name"] for c in [*spec.get("initContainers", []), *spec["containers"]] for e in c.get("env", [])]
        assert "HF_TOKEN" not in envs, pod["metadata"]["name"]
        if pod["metadata"]["labels"][COMPONENT] == "gateway":
            continue
        (volume,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        (init,) = spec["initContainers"]
        assert init["command"] == ["omnimodel", "wait-weights"]
        (init_status,) = pod["status"]["initContainerStatuses"]
        assert init_status["state"]["terminated"]["exitCode"] == 0

    # What the fetch recorded in the claim: the union, and per stage its share.
    cache = pods.claim_dir(claim) / HUB_CACHE_IN_CLAIM
    marker = read_marker(cache, HF_REPO, sha)
    assert isinstance(marker, Marker)
    assert marker.files == union
    assert marker.repo_files == mirror.files(HF_REPO)

    # 2. The decode pod reads only its own subfolder: the view its engine loaded holds the shared configs
    #    and vae/ and nothing else, each a link into the claim, which is read-only in its mount namespace.
    decode = stage_files(mirror, "decode")
    assert set(decode) - set(SHARED_CONFIGS), decode
    assert all(f in SHARED_CONFIGS or f.startswith("vae/") for f in decode), decode
    assert set(marker.stages["decode"].files) == set(decode)
    assert marker.stages["decode"].bytes == sum(decode.values()) < marker.bytes
    (decode_proc,) = pods.processes(f"{name}-decode-")
    view = view_of(decode_proc)
    assert set(view["files"]) == set(decode)
    linked = {p.relative_to(view["dir"]).as_posix() for p in view["dir"].rglob("*") if p.is_symlink()}
    assert linked == set(decode)
    # The links name the claim where the container mounts it (read-only), and the files are the claim's.
    mounted = read_only_mounts(decode_proc.proc.pid)
    claim_dir = pods.claim_dir(claim).resolve()
    assert str(claim_dir) in mounted, mounted
    in_container = f"{mounted[str(claim_dir)]}/{HUB_CACHE_IN_CLAIM}/"
    for path in linked:
        target = os.readlink(view["dir"] / path)
        assert target.startswith(in_container), (path, target)
        assert (cache / target.removeprefix(in_container)).is_file(), (path, target)

    # The image through the gateway, with the official client.
    base = f"http://{name}-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: healthy(base), 240, interval=0.5, what="gateway /health 200 (every stage warm)")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    image = generate(client)
    assert image[:8] == b"\x89PNG\r\n\x1a\n"

    # 3. Three decode replicas: they load from the claim; the mirror hears nothing more, no Job runs again.
    quiet = mirror.log_mark()
    doc = omnimodel(name, mirror, {"storageClassName": "testbed-rwx", "size": "1Gi"})
    doc["spec"]["stages"][2]["replicas"] = 3
    kube.apply(doc)
    kube.wait_ready(name, timeout=300)
    wait_for(lambda: len(pods.processes(f"{name}-decode-")) == 3, 60, what="three decode processes")
    decoders = pods.processes(f"{name}-decode-")
    wait_for(
        lambda: all(healthy(f"http://{p.ip}:8001") for p in decoders), 240, interval=0.5, what="three warm decoders"
    )
    wait_for(
        lambda: len(httpx.get(f"{base}/health", timeout=5).json()["stages"]["decode"]["endpoints"]) == 3,
        60,
        interval=0.5,
        what="the gateway sees the three decode pods",
    )
    for proc in decoders:
        assert set(view_of(proc)["files"]) == set(decode)
    assert generate(client)[:8] == b"\x89PNG\r\n\x1a\n"
    assert mirror.access_log(quiet) == []
    (again,) = fetch_jobs(kube, name)
    assert again["metadata"]["uid"] == job["metadata"]["uid"]
    assert len(kube.pods(f"{INSTANCE}={name},{COMPONENT}=fetch")) == 1


def test_a_rejected_token_fails_the_fetch_at_once_and_says_why(
    kube: Kube, pods: PodRunner, published: Published
) -> None:
    """4. The mirror (olah_server.py, Hub semantics) answers an unknown token 401; the fetch exits 3
    (a retry cannot help), the Job's podFailurePolicy fails it without a retry, WeightsReady says why."""
    mirror = published.mirror
    name = "t2i-badtoken"
    kube.apply(token_secret(BAD_TOKEN))
    # A claim the user made (model.cache.pvc), bound by the pod runner as a static volume would be.
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "weights"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
    )
    mark = mirror.log_mark()
    kube.apply(omnimodel(name, mirror, {"pvc": "weights"}))

    weights_ready = wait_for(
        lambda: (c := condition(kube, name, "WeightsReady")).get("reason") == "Unauthorized" and c,
        180,
        what="WeightsReady False with reason Unauthorized",
    )
    assert weights_ready["status"] == "False"
    weights = kube.get("omnimodel", name)["status"]["weights"]
    assert (weights["state"], weights["reason"]) == ("Failed", "Unauthorized"), weights
    assert "gave up" in weights["message"], weights
    ready = condition(kube, name, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "WeightsFailed"), ready

    # The Job failed by its podFailurePolicy on the first pod's exit code 3: no retry.
    (job,) = fetch_jobs(kube, name)
    failed = job_condition(job, "Failed")
    assert failed.get("reason") == "PodFailurePolicy", job["status"]
    (fetch_pod,) = kube.pods(f"{INSTANCE}={name},{COMPONENT}=fetch")
    assert fetch_pod["status"]["phase"] == "Failed"
    (state,) = [s["state"]["terminated"] for s in fetch_pod["status"]["containerStatuses"]]
    assert state["exitCode"] == 3 and state["message"].startswith("Unauthorized:"), state
    assert state["message"].strip() in weights["message"]  # the fetch's own words

    # The mirror saw the wrong token only, refused it, and sent no file.
    seen = [e for e in mirror.access_log(mark) if e.repo == HF_REPO]
    assert seen and {(e.token, e.status) for e in seen} == {("invalid", 401)}, seen
    assert mirror.downloads(mark) == {}

    # No stage loads a model that is not there: each waits in its init container.
    for stage in ("encode", "denoise", "decode"):
        (pod,) = kube.pods(f"{INSTANCE}={name},{STAGE}={stage}")
        assert pod["status"]["phase"] == "Pending", pod["status"]
        (init_status,) = pod["status"]["initContainerStatuses"]
        assert "running" in init_status["state"], init_status
        assert not pods.processes(f"{name}-{stage}-")  # its engine never started (the gateway did)


def generate(client: openai.OpenAI) -> bytes:
    (model,) = [m.id for m in client.models.list().data]
    result = client.images.generate(
        model=model,
        prompt="a lighthouse at dawn",
        size="64x64",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 7},
    )
    assert result.data and result.data[0].b64_json
    return base64.b64decode(result.data[0].b64_json)
