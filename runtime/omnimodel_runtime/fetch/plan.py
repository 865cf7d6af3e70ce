"""Which files of which revision each stage of a pipeline needs, from the Hub or from a marker."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from omnimodel_runtime.fetch import cache as layout
from omnimodel_runtime.fetch import hub
from omnimodel_runtime.fetch.hub import INVALID, NOT_FOUND, WeightsError
from omnimodel_runtime.pipeline import (
    ModelSource,
    Pipeline,
    Stage,
    StageFilesError,
    needs_weight_map,
    select_files,
)

DEFAULT_REVISION = "main"


def hf_repo(source: ModelSource) -> str | None:
    """``org/name`` of an ``hf://`` source, else None (other schemes need no fetch)."""
    if source.scheme != "hf":
        return None
    return source.source.split("://", 1)[1].strip("/")


def revision_of(source: ModelSource) -> str:
    return source.revision or DEFAULT_REVISION


@dataclass(frozen=True)
class WeightsPlan:
    """One revision of a repository and the files each stage in ``stages`` needs from it."""

    repo: str
    revision: str
    sha: str
    repo_files: Mapping[str, int]
    stages: Mapping[str, tuple[str, ...]]
    # The checkpoint index the stages' tensor prefixes were resolved with, and those prefixes per stage.
    index: str | None
    prefixes: Mapping[str, tuple[str, ...]]

    @property
    def union(self) -> dict[str, int]:
        return {path: self.repo_files[path] for files in self.stages.values() for path in files}

    def stage_bytes(self, stage: str) -> int:
        return sum(self.repo_files[path] for path in self.stages[stage])

    @property
    def repo_bytes(self) -> int:
        return sum(self.repo_files.values())

    def records(self) -> dict[str, layout.StageRecord]:
        return {
            name: layout.StageRecord(files=files, bytes=self.stage_bytes(name)) for name, files in self.stages.items()
        }

    def summary(self) -> str:
        """One line per stage: files, bytes and the fraction of the repository."""
        total = self.repo_bytes or 1
        return "; ".join(
            f"{name}: {len(files)} files, {self.stage_bytes(name)} bytes ({100 * self.stage_bytes(name) / total:.2f}%)"
            for name, files in self.stages.items()
        )


def pick_stages(pipeline: Pipeline, names: Iterable[str] | None) -> list[Stage]:
    wanted = list(names or [])
    if not wanted:
        return list(pipeline.stages)
    return [pipeline.stage(name) for name in wanted]


def build_plan(
    repo: str,
    revision: str,
    sha: str,
    repo_files: Mapping[str, int],
    stages: Iterable[Stage],
    read_index: Callable[[str], str],
) -> WeightsPlan:
    """The plan for ``stages`` given the repository listing; ``read_index(name)`` returns the checkpoint
    index's text when some stage has tensor prefixes."""
    stage_list = list(stages)
    index = next((i for s in stage_list if (i := needs_weight_map(s.files, repo_files)) is not None), None)
    weight_map: dict[str, str] | None = None
    if index is not None:
        try:
            data = json.loads(read_index(index))
            weight_map = {str(k): str(v) for k, v in data["weight_map"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise WeightsError(INVALID, f"{repo}@{sha}: {index} is not a checkpoint index: {err}") from err
    chosen: dict[str, tuple[str, ...]] = {}
    prefixes: dict[str, tuple[str, ...]] = {}
    for stage in stage_list:
        try:
            chosen[stage.name] = select_files(stage.files, repo_files, weight_map)
        except StageFilesError as err:
            raise WeightsError(INVALID, f"stage {stage.name} of {repo}@{sha}: {err}") from err
        if not chosen[stage.name]:
            raise WeightsError(INVALID, f"stage {stage.name}: no file of {repo}@{sha} matches its file patterns")
        if stage.files is not None and stage.files.tensor_prefixes:
            prefixes[stage.name] = stage.files.tensor_prefixes
    return WeightsPlan(
        repo=repo,
        revision=revision,
        sha=sha,
        repo_files=dict(repo_files),
        stages=chosen,
        index=index,
        prefixes=prefixes,
    )


def plan_from_hub(source: ModelSource, stages: Iterable[Stage], cache: Path) -> WeightsPlan:
    """Resolve the revision, list the repository and (for tensor prefixes) fetch its checkpoint index."""
    repo = hf_repo(source)
    assert repo is not None
    revision = revision_of(source)
    # A pinned sha already fetched needs no lookup; a branch or tag is resolved every time (it may move).
    pinned = layout.FULL_SHA.match(revision) is not None and layout.read_marker(cache, repo, revision) is not None
    sha = revision if pinned else hub.resolve_revision(repo, revision)
    marker = layout.read_marker(cache, repo, sha)
    repo_files = marker.repo_files if marker is not None else hub.list_files(repo, sha)

    def read_index(name: str) -> str:
        snapshot = layout.snapshot_dir(cache, repo, sha)
        if not layout.present(snapshot, name, repo_files.get(name)):
            hub.download_file(repo, sha, name, cache)
        return (snapshot / name).read_text()

    return build_plan(repo, revision, sha, repo_files, stages, read_index)


def plan_from_marker(marker: layout.Marker, stages: Iterable[Stage], cache: Path) -> WeightsPlan:
    """The plan a completed fetch allows, without the network (the index is read from the snapshot)."""
    snapshot = layout.snapshot_dir(cache, marker.repo, marker.sha)

    def read_index(name: str) -> str:
        try:
            return (snapshot / name).read_text()
        except OSError as err:
            raise WeightsError(NOT_FOUND, f"{marker.repo}@{marker.sha}: {name} is not in the cache {cache}") from err

    return build_plan(marker.repo, marker.revision, marker.sha, marker.repo_files, stages, read_index)
