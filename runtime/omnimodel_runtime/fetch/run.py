"""The three uses of the cache: fetch a pipeline's weights, wait for them, and give a stage its files."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from omnimodel_runtime.fetch import cache as layout
from omnimodel_runtime.fetch import hub
from omnimodel_runtime.fetch.hub import FAILED, NO_SPACE, NOT_FOUND, WeightsError
from omnimodel_runtime.fetch.plan import (
    WeightsPlan,
    hf_repo,
    pick_stages,
    plan_from_hub,
    plan_from_marker,
    revision_of,
)
from omnimodel_runtime.fetch.progress import COMPLETE, DOWNLOADING, RESOLVING, SKIPPED, FetchProgress
from omnimodel_runtime.pipeline import ModelSource, Pipeline, Stage

log = logging.getLogger("omnimodel_runtime.fetch")

# Files downloaded at once; small files dominate counts, a few large ones the bytes.
DOWNLOAD_WORKERS = 4
# Free space kept beyond what the missing files need before a fetch starts (temporary files, metadata).
SPACE_MARGIN = 64 * 1024 * 1024


@dataclass(frozen=True)
class FetchResult:
    plan: WeightsPlan | None
    downloaded_files: int
    downloaded_bytes: int
    marker: Path | None

    def message(self) -> str:
        """The one-line termination message of a successful fetch."""
        if self.plan is None:
            return "Skipped: not an hf:// model source, nothing to fetch"
        union = self.plan.union
        # Each stage's share: the operator sizes the memory of stages that hold weights in host memory.
        stages = " ".join(f"{name}={self.plan.stage_bytes(name)}" for name in self.plan.stages)
        return (
            f"Complete: {self.plan.repo}@{self.plan.sha}: {len(union)} files, {sum(union.values())} bytes, "
            f"{self.downloaded_bytes} bytes downloaded; stage bytes: {stages}"
        )


def fetch_pipeline(
    pipeline: Pipeline,
    cache: Path,
    *,
    stages: Iterable[str] | None = None,
    progress: FetchProgress | None = None,
    workers: int = DOWNLOAD_WORKERS,
) -> FetchResult:
    """Download the union of the (selected) stages' files of the pipeline's ``hf://`` model into ``cache``
    and write the revision's marker. Files already there are not downloaded again."""
    progress = progress or FetchProgress(pipeline.model.source)
    repo = hf_repo(pipeline.model)
    if repo is None:
        progress.update(state=SKIPPED)
        return FetchResult(plan=None, downloaded_files=0, downloaded_bytes=0, marker=None)
    revision = revision_of(pipeline.model)
    progress.update(state=RESOLVING, repo=repo, revision=revision)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        plan = plan_from_hub(pipeline.model, pick_stages(pipeline, stages), cache)
        progress.update(sha=plan.sha, stage_bytes={name: plan.stage_bytes(name) for name in plan.stages})
        log.info("fetch %s@%s is %s; %s", repo, revision, plan.sha, plan.summary())
        with layout.fetch_lock(cache, repo, plan.sha):
            downloaded = _download(plan, cache, progress, workers)
            marker = _write_marker(plan, cache)
    except Exception as err:
        failure = hub.classify(err, repo=repo, revision=revision)
        if not isinstance(err, WeightsError):
            log.debug("fetch failed", exc_info=err)
        progress.fail(failure.reason, failure.message)
        layout.write_error(cache, repo, revision, failure.reason, failure.message)
        raise failure from err
    progress.update(state=COMPLETE)
    return FetchResult(plan=plan, downloaded_files=downloaded[0], downloaded_bytes=downloaded[1], marker=marker)


def _download(plan: WeightsPlan, cache: Path, progress: FetchProgress, workers: int) -> tuple[int, int]:
    snapshot = layout.snapshot_dir(cache, plan.repo, plan.sha)
    union = plan.union
    missing = layout.missing_files(snapshot, union)
    need = sum(union[p] for p in missing)
    progress.planned(len(union), sum(union.values()), len(union) - len(missing), sum(union.values()) - need)
    if not missing:
        log.info("fetch %s@%s: all %d files already in %s", plan.repo, plan.sha, len(union), cache)
        return 0, 0
    free = shutil.disk_usage(cache).free
    if need + SPACE_MARGIN > free:
        raise WeightsError(
            NO_SPACE, f"{plan.repo}@{plan.sha} needs {need} more bytes in {cache}, which has {free} bytes free"
        )
    progress.update(state=DOWNLOADING, in_flight=lambda: layout.incomplete_bytes(cache, plan.repo))
    log.info("fetch %s@%s: downloading %d files, %d bytes", plan.repo, plan.sha, len(missing), need)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(missing))), thread_name_prefix="fetch") as pool:

        def one(path: str) -> None:
            hub.download_file(plan.repo, plan.sha, path, cache)
            progress.file_done(union[path])
            log.info("fetched %s (%d bytes)", path, union[path])

        futures = [pool.submit(one, path) for path in missing]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                for other in futures:
                    other.cancel()
                raise future.exception()  # type: ignore[misc]
    still = layout.missing_files(snapshot, union)
    if still:
        raise WeightsError(FAILED, f"{plan.repo}@{plan.sha}: downloaded, but {', '.join(still[:5])} are not in {cache}")
    return len(missing), need


def _write_marker(plan: WeightsPlan, cache: Path) -> Path:
    previous = layout.read_marker(cache, plan.repo, plan.sha)
    files = dict(previous.files) if previous else {}
    files.update(plan.union)
    stages = dict(previous.stages) if previous else {}
    stages.update(plan.records())
    marker = layout.Marker(
        repo=plan.repo,
        revision=plan.revision,
        sha=plan.sha,
        endpoint=hub.endpoint(),
        completed_at=layout.now_iso(),
        repo_files=dict(plan.repo_files),
        files=files,
        stages=stages,
    )
    return layout.write_marker(cache, marker)


# ---------------------------------------------------------------- waiting (init containers)


@dataclass(frozen=True)
class WaitStatus:
    ready: bool
    message: str


def weights_status(pipeline: Pipeline, cache: Path, stage: str) -> WaitStatus:
    """Whether ``stage``'s files of the pipeline's revision are in ``cache``, and what is missing."""
    repo = hf_repo(pipeline.model)
    if repo is None:
        return WaitStatus(True, f"{pipeline.model.source} is not an hf:// source: nothing to wait for")
    revision = revision_of(pipeline.model)
    where = f"{repo}@{revision}"
    sha = layout.cached_sha(cache, repo, revision)
    marker = layout.read_marker(cache, repo, sha) if sha else None
    if marker is None:
        error = layout.read_error(cache, repo)
        failed = f"; the last fetch failed: {error['reason']}: {error['message']}" if error else ""
        return WaitStatus(
            False, f"waiting for {where}: no completion marker in {layout.marker_dir(cache, repo)}{failed}"
        )
    try:
        plan = plan_from_marker(marker, [pipeline.stage(stage)], cache)
    except WeightsError as err:
        return WaitStatus(False, f"waiting for {where} ({marker.sha}), stage {stage}: {err}")
    snapshot = layout.snapshot_dir(cache, repo, marker.sha)
    need = {p: plan.repo_files[p] for p in plan.stages[stage]}
    missing = layout.missing_files(snapshot, need)
    if missing:
        return WaitStatus(
            False,
            f"waiting for {where} ({marker.sha}), stage {stage}: {len(missing)} of {len(need)} files not in the "
            f"cache (e.g. {', '.join(missing[:3])}); the marker's fetch did not include them",
        )
    return WaitStatus(
        True, f"weights ready for stage {stage}: {where} ({marker.sha}), {len(need)} files, {sum(need.values())} bytes"
    )


def wait_for_weights(
    pipeline: Pipeline,
    cache: Path,
    stage: str,
    *,
    timeout: float | None = None,
    interval: float = 10.0,
    poll: float = 1.0,
    say: Callable[[str], None] = print,
) -> bool:
    """Poll until :func:`weights_status` is ready (True) or ``timeout`` passes (False), saying what it
    waits for at least every ``interval`` seconds."""
    pipeline.stage(stage)  # an unknown stage is a configuration error, not something to wait for
    start = time.monotonic()
    last_said = -float("inf")
    while True:
        status = weights_status(pipeline, cache, stage)
        if status.ready:
            say(status.message)
            return True
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout:
            say(f"timed out after {elapsed:.0f} s {status.message}")
            return False
        if elapsed - last_said >= interval:
            say(f"[{elapsed:.0f} s] {status.message}")
            last_said = elapsed
        time.sleep(poll)


# ---------------------------------------------------------------- a stage's model directory


def stage_model_dir(source: ModelSource, stage: Stage | None, cache: Path | None = None) -> Path:
    """The directory a stage loads an ``hf://`` model from.

    - The revision's marker is in ``cache``: a view of the stage's files there, without the network.
    - No marker (no fetch ran): the stage's own files only are downloaded into ``cache``, then the view.
    - No marker and ``HF_HUB_OFFLINE``: whatever snapshot a pre-filled cache holds, as a plain
      ``huggingface_hub`` client would find it.

    ``stage=None`` (a tool that loads the whole model) takes every file.
    """
    repo = hf_repo(source)
    if repo is None:
        raise ValueError(f"{source.source} is not an hf:// source")
    cache = cache or layout.default_cache_dir()
    revision = revision_of(source)
    stages = [stage] if stage is not None else []
    name = stage.name if stage is not None else "all"
    sha = layout.cached_sha(cache, repo, revision)
    marker = layout.read_marker(cache, repo, sha) if sha else None
    if marker is not None:
        plan = plan_from_marker(marker, stages or [_whole(source)], cache)
        key = stage.name if stage is not None else "all"
        snapshot = layout.snapshot_dir(cache, repo, marker.sha)
        need = {p: plan.repo_files[p] for p in plan.stages[key]}
        missing = layout.missing_files(snapshot, need)
        if missing:
            raise WeightsError(
                NOT_FOUND,
                f"the cache {cache} holds {repo}@{marker.sha} but not {len(missing)} files stage {name} needs "
                f"(e.g. {', '.join(missing[:3])}): fetch this pipeline again",
            )
        log.info("stage %s loads %s@%s from the cache %s (%s)", name, repo, marker.sha, cache, plan.summary())
        return _view(plan, cache, key)
    if hub.offline():
        log.info(
            "stage %s: no fetched %s@%s in %s and HF_HUB_OFFLINE is set: using the local snapshot",
            name,
            repo,
            revision,
            cache,
        )
        return hub.local_snapshot(repo, revision)
    cache.mkdir(parents=True, exist_ok=True)
    plan = plan_from_hub(source, stages or [_whole(source)], cache)
    key = stage.name if stage is not None else "all"
    log.info("stage %s downloads only its files of %s@%s into %s: %s", name, repo, plan.sha, cache, plan.summary())
    progress = FetchProgress(source.source)
    progress.update(repo=repo, revision=revision, sha=plan.sha)
    _download(plan, cache, progress, DOWNLOAD_WORKERS)
    return _view(plan, cache, key)


def _whole(source: ModelSource) -> Stage:
    from omnimodel_runtime.pipeline import EngineName, StageKind  # noqa: PLC0415

    return Stage(name="all", kind=StageKind.AR, engine=EngineName.TRANSFORMERS, task="all")


def _view(plan: WeightsPlan, cache: Path, stage: str) -> Path:
    snapshot = layout.snapshot_dir(cache, plan.repo, plan.sha)
    prefixes = plan.prefixes.get(stage, ())
    label = f"{layout.repo_key(plan.repo)}-{plan.sha[:12]}-{stage}"
    return layout.stage_view(snapshot, plan.stages[stage], label=label, index=plan.index, prefixes=prefixes)
