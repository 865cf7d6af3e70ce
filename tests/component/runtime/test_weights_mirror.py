"""Weights through a real Hugging Face mirror: olah on loopback (omnimodel_testbed.hfmirror) serving the tiny
models over the Hub protocol, the real ``huggingface_hub`` client in ``omnimodel fetch``, ``wait-weights``,
``stage`` and ``serve`` processes, and the mirror's access log as the record of every byte sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from runtime_procs import free_port, png_pixels, running, runtime_env, serve_process, stage_process, wait_for

from omnimodel_runtime.pipeline import ModelSource, Pipeline, get_preset, needs_weight_map, select_files
from omnimodel_testbed.hfmirror import HubMirror, shard_by_prefix

T2I, TTS, OMNI, PRIVATE = "acme/tiny-t2i", "acme/tiny-tts", "acme/tiny-omni", "acme/private-tts"
PRESET_OF = {T2I: "text-to-image", TTS: "tts", OMNI: "qwen2.5-omni", PRIVATE: "tts"}
OMNI_PREFIXES = ("thinker.", "talker.", "token2wav.")
GOOD_TOKEN = "hf_testbed_good"


@dataclass
class Bed:
    mirror: HubMirror
    dirs: dict[str, Path]  # repo -> the directory published
    shas: dict[str, str]

    def pipeline(self, repo: str, revision: str | None = None) -> Pipeline:
        return get_preset(PRESET_OF[repo]).pipeline(ModelSource(source=f"hf://{repo}", revision=revision))

    def expected(self, repo: str, stage: str) -> dict[str, int]:
        """What ``stage`` needs of ``repo``: its file set over the mirror's own listing, with sizes."""
        listing = self.mirror.files(repo)
        files = self.pipeline(repo).stage(stage).files
        index = needs_weight_map(files, listing)
        weight_map = json.loads((self.dirs[repo] / index).read_text())["weight_map"] if index else None
        return {path: listing[path] for path in select_files(files, listing, weight_map)}


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Bed]:
    from omnimodel_runtime.tiny import ensure_tiny

    root = tmp_path_factory.mktemp("hfmirror")
    dirs = {
        T2I: ensure_tiny("text-to-image", model_cache),
        TTS: ensure_tiny("tts", model_cache),
        # The released Qwen2.5-Omni ships its checkpoint in shards; the tiny one is laid out the same way,
        # one shard per part, so that each stage's share is a set of whole files.
        OMNI: shard_by_prefix(ensure_tiny("qwen2.5-omni", model_cache), root / "omni-sharded", OMNI_PREFIXES),
    }
    dirs[PRIVATE] = dirs[TTS]
    mirror = HubMirror(root / "mirror", host="127.0.0.7").start()
    assert HubMirror.attach(root / "mirror").running  # what another process (a cluster fixture) would do
    try:
        shas = {repo: mirror.publish(path, repo) for repo, path in dirs.items()}
        mirror.require_token(PRIVATE, GOOD_TOKEN)
        yield Bed(mirror=mirror, dirs=dirs, shas=shas)
    finally:
        mirror.stop()


def hub_env(bed: Bed, cache: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "OMNIMODEL_"))}
    env["HF_ENDPOINT"] = bed.mirror.url
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    if cache is not None:
        env["HF_HUB_CACHE"] = str(cache)
    env.update(extra)
    return env


def omnimodel(args: list[str], env: Mapping[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnimodel_runtime", *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def fetch(bed: Bed, tmp: Path, pipeline: Pipeline, cache: Path, *extra: str, **env: str) -> tuple[int, str, str]:
    path = tmp / f"pipeline-{time.monotonic_ns()}.json"
    path.write_text(pipeline.to_json())
    term = tmp / f"termination-{time.monotonic_ns()}.log"
    args = ["fetch", "--pipeline", str(path), "--cache-dir", str(cache), "--termination-log", str(term), *extra]
    proc = omnimodel(args, hub_env(bed, **env))
    return proc.returncode, term.read_text().strip() if term.exists() else "", proc.stderr


RESOLVE_STAGE = """
import sys
from omnimodel_runtime.models import resolve_model_dir
from omnimodel_runtime.pipeline import load_pipeline
from omnimodel_runtime.settings import RuntimeSettings
pipeline = load_pipeline(sys.argv[1])
print(resolve_model_dir(pipeline.model, RuntimeSettings(), pipeline.stage(sys.argv[2])))
"""


def start_stage_model(bed: Bed, tmp: Path, pipeline: Pipeline, stage: str, cache: Path, **env: str) -> Path:
    """What ``omnimodel stage`` does before its engine loads: resolve the stage's model directory."""
    path = tmp / f"pipeline-{time.monotonic_ns()}.json"
    path.write_text(pipeline.to_json())
    proc = subprocess.run(
        [sys.executable, "-c", RESOLVE_STAGE, str(path), stage],
        env=hub_env(bed, cache, TMPDIR=str(tmp), **env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def view_files(view: Path) -> set[str]:
    return {str(p.relative_to(view)) for p in view.rglob("*") if p.is_file() and not p.name.startswith(".omnimodel")}


# ---------------------------------------------------------------- only what each stage needs


@pytest.mark.slow
@pytest.mark.parametrize("repo", [T2I, TTS, OMNI])
def test_a_stage_without_a_cache_downloads_only_its_own_files(bed: Bed, tmp_path: Path, repo: str) -> None:
    pipeline = bed.pipeline(repo)
    repo_bytes = sum(bed.mirror.files(repo).values())
    shares = {}
    for stage in pipeline.stages:
        mark = bed.mirror.log_mark()
        view = start_stage_model(bed, tmp_path, pipeline, stage.name, tmp_path / f"cache-{stage.name}")
        expected = bed.expected(repo, stage.name)
        assert bed.mirror.downloads(since=mark) == expected, stage.name
        assert view_files(view) == set(expected), stage.name
        shares[stage.name] = sum(expected.values()) / repo_bytes
    print(f"{repo}: " + ", ".join(f"{k} {100 * v:.2f}%" for k, v in shares.items()))
    # No stage needs the whole repository, and between them they need every weight file.
    assert all(share < 1 for share in shares.values())
    weights = {p for p in bed.mirror.files(repo) if p.endswith(".safetensors")}
    assert weights <= set().union(*(bed.expected(repo, s.name) for s in pipeline.stages))


@pytest.mark.slow
def test_fetch_once_then_replicas_and_restarts_fetch_nothing(bed: Bed, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    pipeline = bed.pipeline(T2I)
    union: dict[str, int] = {}
    for stage in pipeline.stages:
        union.update(bed.expected(T2I, stage.name))

    mark = bed.mirror.log_mark()
    rc, message, stderr = fetch(bed, tmp_path, pipeline, cache)
    assert rc == 0, stderr
    # Each stage's own share closes the line: the operator sizes CPU stages' memory from it.
    shares = " ".join(f"{s.name}={sum(bed.expected(T2I, s.name).values())}" for s in pipeline.stages)
    assert message == f"Complete: {T2I}@{bed.shas[T2I]}: {len(union)} files, {sum(union.values())} bytes, " + (
        f"{sum(union.values())} bytes downloaded; stage bytes: {shares}"
    )
    assert bed.mirror.downloads(since=mark) == union
    marker = json.loads((cache / ".omnimodel" / "acme--tiny-t2i" / f"{bed.shas[T2I]}.json").read_text())
    assert marker["sha"] == bed.shas[T2I]
    assert {name: set(s["files"]) for name, s in marker["stages"].items()} == {
        s.name: set(bed.expected(T2I, s.name)) for s in pipeline.stages
    }

    # The fetch Job runs again (a restart, a second OmniModel of the same revision): nothing is sent.
    mark = bed.mirror.log_mark()
    rc, message, stderr = fetch(bed, tmp_path, pipeline, cache)
    assert rc == 0, stderr
    assert ", 0 bytes downloaded; stage bytes: " in message
    entries = bed.mirror.access_log(since=mark)
    assert bed.mirror.downloads(since=mark) == {}
    assert {e.path for e in entries if e.repo} == {f"/api/models/{T2I}/revision/main"}  # the sha lookup only

    # Pinned to the sha it fetched, not even that lookup.
    mark = bed.mirror.log_mark()
    rc, message, stderr = fetch(bed, tmp_path, bed.pipeline(T2I, revision=bed.shas[T2I]), cache)
    assert rc == 0, stderr
    assert [e for e in bed.mirror.access_log(since=mark) if e.repo] == []

    # Two replicas of the decode stage, and one restarted: the cache only, not one request to the mirror.
    mark = bed.mirror.log_mark()
    for _replica in range(3):
        view = start_stage_model(bed, tmp_path, pipeline, "decode", cache, HF_HUB_OFFLINE="1")
        assert view_files(view) == set(bed.expected(T2I, "decode"))
    assert bed.mirror.access_log(since=mark) == []


@pytest.mark.slow
def test_fetch_serves_its_progress_while_it_runs(bed: Bed, tmp_path: Path) -> None:
    pipeline = bed.pipeline(TTS)
    path = tmp_path / "pipeline.json"
    path.write_text(pipeline.to_json())
    port = free_port()
    total = sum(bed.expected(TTS, "acoustic").values()) + sum(bed.expected(TTS, "vocoder").values())
    bed.mirror.set_rate(total // 4)  # about four seconds
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omnimodel_runtime",
                "fetch",
                "--pipeline",
                str(path),
                "--cache-dir",
                str(tmp_path / "cache"),
                "--termination-log",
                str(tmp_path / "term"),
                "--progress-port",
                str(port),
                "--log-interval",
                "1",
            ],
            env=hub_env(bed),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen: list[dict[str, object]] = []

        def midway() -> bool:
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/progress", timeout=1).json()
            except httpx.HTTPError:
                return False
            seen.append(body)
            return body["state"] == "downloading" and 0 < int(body["bytes_done"]) < int(body["bytes_total"])

        wait_for(midway, timeout=30, what="/progress to show a download in flight")
        out, _ = proc.communicate(timeout=60)
    finally:
        bed.mirror.set_rate(None)
    assert proc.returncode == 0, out
    last = seen[-1]
    assert last["repo"] == TTS
    assert last["sha"] == bed.shas[TTS]
    assert last["bytes_total"] == total
    assert last["files_total"] == len(bed.expected(TTS, "acoustic")) + len(bed.expected(TTS, "vocoder"))
    assert last["error"] is None
    assert "downloading" in out
    assert "%" in out  # the periodic progress lines


# ---------------------------------------------------------------- failures, classified


@pytest.mark.slow
def test_a_private_repository_needs_the_right_token(bed: Bed, tmp_path: Path) -> None:
    pipeline = bed.pipeline(PRIVATE)
    rc, message, _ = fetch(bed, tmp_path, pipeline, tmp_path / "c1", HF_TOKEN="hf_wrong")
    assert rc == 3  # permanent: the operator's Job fails at once rather than retrying
    assert message.startswith("Unauthorized: "), message
    assert "401" in message
    assert "hf_wrong" not in message
    rc, message, _ = fetch(bed, tmp_path, pipeline, tmp_path / "c2")
    assert rc == 3
    assert message.startswith("NotFound: repository acme/private-tts not found"), message
    assert "no HF_TOKEN is set" in message
    rc, message, stderr = fetch(bed, tmp_path, pipeline, tmp_path / "c3", HF_TOKEN=GOOD_TOKEN)
    assert rc == 0, stderr
    assert message.startswith(f"Complete: {PRIVATE}@")


@pytest.mark.slow
def test_a_missing_revision_or_repository_is_not_found(bed: Bed, tmp_path: Path) -> None:
    rc, message, _ = fetch(bed, tmp_path, bed.pipeline(T2I, revision="v9"), tmp_path / "c")
    assert (rc, message) == (3, f"NotFound: revision 'v9' not found in {T2I} at {bed.mirror.url}")
    missing = get_preset("text-to-image").pipeline(ModelSource(source="hf://acme/nothing-here"))
    rc, message, _ = fetch(bed, tmp_path, missing, tmp_path / "c")
    assert rc == 3
    assert message.startswith("NotFound: repository acme/nothing-here not found"), message


@pytest.mark.slow
def test_an_unreachable_endpoint_is_a_network_failure(bed: Bed, tmp_path: Path) -> None:
    rc, message, _ = fetch(
        bed, tmp_path, bed.pipeline(T2I), tmp_path / "c", HF_ENDPOINT=f"http://127.0.0.1:{free_port()}"
    )
    assert rc == 1  # transient: worth a retry
    assert message.startswith("Network: cannot reach"), message


@pytest.mark.slow
def test_a_tagged_revision_is_pinned_to_its_sha(bed: Bed, tmp_path: Path) -> None:
    sha = bed.mirror.tag(T2I, "v1")
    rc, message, stderr = fetch(bed, tmp_path, bed.pipeline(T2I, revision="v1"), tmp_path / "c", "--stage", "decode")
    assert rc == 0, stderr
    assert message.startswith(f"Complete: {T2I}@{sha}: 4 files")
    assert (tmp_path / "c" / ".omnimodel" / "acme--tiny-t2i" / "refs" / "v1").read_text().strip() == sha


# ---------------------------------------------------------------- init containers


@pytest.mark.slow
def test_wait_weights_waits_for_the_fetch(bed: Bed, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    pipeline = bed.pipeline(TTS)
    path = tmp_path / "pipeline.json"
    path.write_text(pipeline.to_json())
    args = ["wait-weights", "--pipeline", str(path), "--cache-dir", str(cache), "--stage", "vocoder"]
    timed_out = omnimodel([*args, "--timeout", "1", "--interval", "0.5"], hub_env(bed))
    assert timed_out.returncode == 1
    assert "timed out after 1 s waiting for acme/tiny-tts@main: no completion marker" in timed_out.stdout

    waiter = subprocess.Popen(
        [sys.executable, "-m", "omnimodel_runtime", *args, "--interval", "1"],
        env=hub_env(bed),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert waiter.stdout is not None
        # It says what it waits for once a second: two such lines are a second of waiting, still running.
        said = [waiter.stdout.readline() for _ in range(2)]
        assert all("waiting for acme/tiny-tts@main" in line for line in said), said
        assert waiter.poll() is None
        rc, _, stderr = fetch(bed, tmp_path, pipeline, cache)
        assert rc == 0, stderr
        out, _ = waiter.communicate(timeout=30)
    finally:
        if waiter.poll() is None:
            waiter.kill()
    assert waiter.returncode == 0, out
    assert f"weights ready for stage vocoder: acme/tiny-tts@main ({bed.shas[TTS]}), 2 files" in out


# ---------------------------------------------------------------- engines on the fetched weights


@pytest.mark.slow
@pytest.mark.engine
def test_fetch_then_serve_answers_an_image_request_offline(bed: Bed, tmp_path: Path, model_cache: Path) -> None:
    cache = tmp_path / "cache"
    rc, _, stderr = fetch(bed, tmp_path, bed.pipeline(T2I), cache)
    assert rc == 0, stderr
    mark = bed.mirror.log_mark()
    env = runtime_env(model_cache, OMP_NUM_THREADS=1, TMPDIR=str(tmp_path))
    env = {k: v for k, v in env.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=bed.mirror.url, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    serve = serve_process("text-to-image", tmp_path, env, model=f"hf://{T2I}")
    with running(serve):
        serve.wait_healthy(timeout=180)
        resp = httpx.post(
            f"{serve.url}/v1/images/generations",
            json={"model": T2I, "prompt": "a red fox", "size": "32x32", "num_inference_steps": 2},
            timeout=120,
        )
        log = serve.log_tail(20000)
    assert resp.status_code == 200, resp.text
    assert png_pixels(resp.json()["data"][0]["b64_json"]).shape == (32, 32, 3)
    assert bed.mirror.access_log(since=mark) == []  # every stage loaded from the cache
    for stage in ("encode", "denoise", "decode"):
        assert f"stage {stage} loads {T2I}@{bed.shas[T2I]} from the cache" in log


@pytest.mark.slow
@pytest.mark.engine
def test_a_stage_process_without_a_cache_loads_what_it_downloaded(bed: Bed, tmp_path: Path, model_cache: Path) -> None:
    path = tmp_path / "pipeline.json"
    path.write_text(bed.pipeline(T2I).to_json())
    env = runtime_env(model_cache, OMP_NUM_THREADS=1, TMPDIR=str(tmp_path))
    env = {k: v for k, v in env.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=bed.mirror.url, HF_HUB_CACHE=str(tmp_path / "emptydir"))
    mark = bed.mirror.log_mark()
    stage = stage_process(path, "decode", free_port(), log_dir=tmp_path, env=env)
    with running(stage):
        stage.wait_healthy(timeout=180)
    assert bed.mirror.downloads(since=mark) == bed.expected(T2I, "decode")
