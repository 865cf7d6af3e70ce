"""The weights cache without a network: fetch logic over a fake Hub, markers, stage views, waiting, reasons.

The real client against a real mirror is tests/component/runtime/test_weights_mirror.py.
"""

from __future__ import annotations

import errno
import json
import tempfile
from collections import namedtuple
from pathlib import Path

import pytest

from omnimodel_runtime.fetch import cache as layout
from omnimodel_runtime.fetch import hub, run
from omnimodel_runtime.fetch.hub import WeightsError
from omnimodel_runtime.pipeline import ModelSource, Pipeline, get_preset

SHA = "a" * 40
T2I = {
    "README.md": b"readme",
    "model_index.json": b'{"_class_name": "QwenImagePipeline"}',
    "scheduler/scheduler_config.json": b"{}",
    "text_encoder/model.safetensors": b"t" * 300,
    "tokenizer/tokenizer.json": b"{}",
    "transformer/config.json": b"{}",
    "transformer/diffusion_pytorch_model.safetensors": b"d" * 700,
    "vae/config.json": b"{}",
    "vae/diffusion_pytorch_model.safetensors": b"v" * 5000,
}
OMNI_INDEX = {
    "metadata": {"total_size": 3},
    "weight_map": {
        "thinker.w": "model-00001-of-00003.safetensors",
        "talker.w": "model-00002-of-00003.safetensors",
        "token2wav.w": "model-00003-of-00003.safetensors",
    },
}
OMNI = {
    "config.json": b"{}",
    "spk_dict.pt": b"spk",
    "model.safetensors.index.json": json.dumps(OMNI_INDEX).encode(),
    "model-00001-of-00003.safetensors": b"1" * 100,
    "model-00002-of-00003.safetensors": b"2" * 20,
    "model-00003-of-00003.safetensors": b"3" * 50,
}


class FakeHub:
    """resolve/list/download of one repository, counting downloads, writing the HF cache layout."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, files: dict[str, bytes]) -> None:
        self.files = files
        self.downloads: list[str] = []
        monkeypatch.setattr(hub, "resolve_revision", lambda repo, revision: SHA)
        monkeypatch.setattr(hub, "list_files", lambda repo, sha: {p: len(b) for p, b in files.items()})
        monkeypatch.setattr(hub, "download_file", self.download)
        monkeypatch.setattr(hub, "endpoint", lambda: "http://mirror.invalid")
        monkeypatch.setattr(hub, "offline", lambda: False)

    def download(self, repo: str, sha: str, path: str, cache: Path) -> Path:
        self.downloads.append(path)
        target = layout.snapshot_dir(cache, repo, sha) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(self.files[path])
        return target


@pytest.fixture(autouse=True)
def _views_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def t2i(repo: str = "acme/t2i", revision: str | None = None) -> Pipeline:
    return get_preset("text-to-image").pipeline(ModelSource(source=f"hf://{repo}", revision=revision))


def test_fetch_downloads_the_union_once_and_marks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHub(monkeypatch, T2I)
    cache = tmp_path / "cache"
    result = run.fetch_pipeline(t2i(), cache)
    assert sorted(fake.downloads) == sorted(set(T2I) - {"README.md"})
    assert result.downloaded_bytes == sum(len(b) for p, b in T2I.items() if p != "README.md")
    marker = layout.read_marker(cache, "acme/t2i", SHA)
    assert marker is not None
    assert marker.stages["decode"].files == (
        "model_index.json",
        "transformer/config.json",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
    )
    assert layout.cached_sha(cache, "acme/t2i", "main") == SHA
    assert result.message().startswith(f"Complete: acme/t2i@{SHA}: 8 files")

    fake.downloads.clear()
    again = run.fetch_pipeline(t2i(), cache)
    assert fake.downloads == []
    assert again.downloaded_bytes == 0


def test_a_plain_hub_client_offline_finds_the_fetched_branch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM-Omni's pods load `org/name` with huggingface_hub offline: the branch must resolve to the fetched sha.
    import huggingface_hub

    FakeHub(monkeypatch, T2I)
    cache = tmp_path / "cache"
    run.fetch_pipeline(t2i(revision="v1"), cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    found = huggingface_hub.snapshot_download("acme/t2i", revision="v1", cache_dir=cache, local_files_only=True)
    assert Path(found) == layout.snapshot_dir(cache, "acme/t2i", SHA)
    config = huggingface_hub.try_to_load_from_cache("acme/t2i", "vae/config.json", cache_dir=cache, revision="v1")
    assert config == str(layout.snapshot_dir(cache, "acme/t2i", SHA) / "vae/config.json")


def test_fetching_one_stage_then_another_merges_the_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHub(monkeypatch, T2I)
    cache = tmp_path / "cache"
    run.fetch_pipeline(t2i(), cache, stages=["decode"])
    assert "text_encoder/model.safetensors" not in fake.downloads
    assert run.weights_status(t2i(), cache, "decode").ready
    assert not run.weights_status(t2i(), cache, "encode").ready
    run.fetch_pipeline(t2i(), cache, stages=["encode"])
    marker = layout.read_marker(cache, "acme/t2i", SHA)
    assert marker is not None
    assert set(marker.stages) == {"decode", "encode"}
    assert run.weights_status(t2i(), cache, "encode").ready


def test_a_stage_loads_a_view_of_only_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeHub(monkeypatch, T2I)
    cache = tmp_path / "cache"
    pipeline = t2i()
    run.fetch_pipeline(pipeline, cache)
    monkeypatch.setattr(hub, "resolve_revision", _no_network)
    monkeypatch.setattr(hub, "download_file", _no_network)
    view = run.stage_model_dir(pipeline.model, pipeline.stage("decode"), cache)
    found = sorted(str(p.relative_to(view)) for p in view.rglob("*") if p.is_file() and p.name != layout.VIEW_MARKER)
    assert found == [
        "model_index.json",
        "transformer/config.json",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    assert (view / "vae/diffusion_pytorch_model.safetensors").read_bytes() == T2I[
        "vae/diffusion_pytorch_model.safetensors"
    ]
    assert run.stage_model_dir(pipeline.model, pipeline.stage("decode"), cache) == view  # reused


def test_without_a_marker_a_stage_downloads_only_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHub(monkeypatch, T2I)
    pipeline = t2i()
    run.stage_model_dir(pipeline.model, pipeline.stage("denoise"), tmp_path / "cache")
    assert sorted(fake.downloads) == [
        "model_index.json",
        "scheduler/scheduler_config.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/config.json",
    ]


def test_omni_stages_get_their_shards_and_an_index_of_only_their_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeHub(monkeypatch, OMNI)
    pipeline = get_preset("qwen2.5-omni").pipeline(ModelSource(source="hf://acme/omni"))
    view = run.stage_model_dir(pipeline.model, pipeline.stage("talker"), tmp_path / "cache")
    assert "model-00001-of-00003.safetensors" not in fake.downloads
    assert "model-00003-of-00003.safetensors" not in fake.downloads
    index = json.loads((view / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"talker.w": "model-00002-of-00003.safetensors"}
    assert sorted(p.name for p in view.iterdir() if p.name != layout.VIEW_MARKER) == [
        "config.json",
        "model-00002-of-00003.safetensors",
        "model.safetensors.index.json",
        "spk_dict.pt",
    ]


def test_a_marker_without_a_stage_s_files_is_an_error_not_a_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeHub(monkeypatch, T2I)
    cache = tmp_path / "cache"
    pipeline = t2i()
    run.fetch_pipeline(pipeline, cache, stages=["decode"])
    fake.downloads.clear()
    with pytest.raises(WeightsError, match="fetch this pipeline again") as err:
        run.stage_model_dir(pipeline.model, pipeline.stage("encode"), cache)
    assert err.value.reason == "NotFound"
    assert fake.downloads == []


def test_too_little_space_fails_before_downloading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHub(monkeypatch, T2I)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(run.shutil, "disk_usage", lambda path: usage(10, 10, 1000))
    cache = tmp_path / "cache"
    with pytest.raises(WeightsError) as err:
        run.fetch_pipeline(t2i(), cache)
    assert err.value.reason == "NoSpace"
    assert str(err.value).startswith("NoSpace: acme/t2i@")
    assert fake.downloads == []
    status = run.weights_status(t2i(), cache, "decode")
    assert not status.ready
    assert "the last fetch failed: NoSpace" in status.message


def test_non_hf_sources_need_no_fetch(tmp_path: Path) -> None:
    pipeline = get_preset("text-to-image").pipeline(ModelSource(source="tiny://text-to-image"))
    result = run.fetch_pipeline(pipeline, tmp_path)
    assert result.message().startswith("Skipped:")
    assert run.weights_status(pipeline, tmp_path, "decode").ready


def test_waiting_times_out_saying_what_it_waits_for(tmp_path: Path) -> None:
    lines: list[str] = []
    ready = run.wait_for_weights(t2i(), tmp_path, "decode", timeout=0.3, interval=0.1, poll=0.05, say=lines.append)
    assert not ready
    assert len(lines) >= 2
    assert lines[-1].startswith("timed out after")
    assert "no completion marker" in lines[-1]
    with pytest.raises(KeyError):
        run.wait_for_weights(t2i(), tmp_path, "nope", timeout=0)


def test_a_pinned_sha_is_found_without_a_ref(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeHub(monkeypatch, T2I)
    run.fetch_pipeline(t2i(revision=SHA), tmp_path)
    assert run.weights_status(t2i(revision=SHA), tmp_path, "decode").ready
    assert not (layout.marker_dir(tmp_path, "acme/t2i") / "refs").exists()
    # Fetched once, a pinned sha is not even looked up again.
    monkeypatch.setattr(hub, "resolve_revision", _no_network)
    monkeypatch.setattr(hub, "list_files", _no_network)
    assert run.fetch_pipeline(t2i(revision=SHA), tmp_path).downloaded_bytes == 0


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "NoSpace"),
        (OSError(errno.EROFS, "Read-only file system"), "Failed"),
        (ConnectionRefusedError(111, "Connection refused"), "Network"),
        (TimeoutError("timed out"), "Network"),
        (RuntimeError("boom"), "Failed"),
    ],
)
def test_failures_are_classified(error: BaseException, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "endpoint", lambda: "http://mirror.invalid")
    wrapped = RuntimeError("download failed")
    wrapped.__cause__ = error
    failure = hub.classify(wrapped, repo="acme/m", revision="main")
    assert failure.reason == reason
    assert "\n" not in str(failure)


def _no_network(*args: object, **kwargs: object) -> None:
    raise AssertionError("the network was used")


def test_the_fetch_command_writes_its_outcome_to_the_termination_log(tmp_path: Path) -> None:
    from omnimodel_runtime import cli

    pipeline = get_preset("tts").pipeline(ModelSource(source="tiny://tts"))
    path = tmp_path / "pipeline.json"
    path.write_text(pipeline.to_json())
    term = tmp_path / "term"
    args = ["fetch", "--pipeline", str(path), "--cache-dir", str(tmp_path / "c"), "--termination-log", str(term)]
    assert cli.main(args) == 0
    assert term.read_text().startswith("Skipped: ")
    assert cli.main(["wait-weights", "--pipeline", str(path), "--stage", "vocoder", "--timeout", "0"]) == 0

    path.write_text("{not json")
    assert cli.main(args) == cli.EXIT_CONFIG
    assert term.read_text().startswith("Invalid: ")
    assert term.read_text().count("\n") == 1


def test_a_taken_progress_port_is_a_configuration_error(tmp_path: Path) -> None:
    import socket

    from omnimodel_runtime import cli

    path = tmp_path / "pipeline.json"
    path.write_text(get_preset("tts").pipeline(ModelSource(source="tiny://tts")).to_json())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        term = tmp_path / "term"
        args = ["fetch", "--pipeline", str(path), "--termination-log", str(term), "--progress-port", str(port)]
        assert cli.main(args) == cli.EXIT_CONFIG
    assert term.read_text().startswith(f"Invalid: cannot serve /progress on 127.0.0.1:{port}")


def test_the_marker_is_readable_by_every_reader_of_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetch Job and the stage pods may be different users of one claim (mkstemp alone makes 0600)."""
    FakeHub(monkeypatch, T2I)
    cache = tmp_path / "cache"
    run.fetch_pipeline(t2i(), cache)
    for path in (layout.marker_path(cache, "acme/t2i", SHA), layout.ref_path(cache, "acme/t2i", "main")):
        assert path.stat().st_mode & 0o044 == 0o044, (path, oct(path.stat().st_mode))
