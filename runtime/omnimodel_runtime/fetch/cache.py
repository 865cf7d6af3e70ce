"""The shared weights cache on disk: Hugging Face's cache layout plus our completion markers.

::

    DIR/models--<org>--<name>/{blobs,snapshots/<sha>,refs}/...   huggingface_hub's own layout
    DIR/.omnimodel/<org>--<name>/<sha>.json                     the completion marker of one revision
    DIR/.omnimodel/<org>--<name>/refs/<revision>                the sha a fetch resolved ``revision`` to
    DIR/.omnimodel/<org>--<name>/last-error.json                the last failed fetch (cleared on success)

``DIR`` is what ``huggingface_hub`` calls the hub cache (``HF_HUB_CACHE``, default ``$HF_HOME/hub``), so a
plain ``huggingface_hub`` client finds the same files. A marker is written last, after every file it
lists is in the snapshot: its presence is what "fetched" means. Readers never write here (a stage mounts
the cache read-only); what a stage loads is a *view*: a directory of symlinks to its own files only,
under the temporary directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict

MARKER_VERSION: Final = "omnimodel.io/weights-v1"
MARKER_DIR: Final = ".omnimodel"
VIEW_MARKER: Final = ".omnimodel-view.json"
FULL_SHA: Final = re.compile(r"^[0-9a-f]{40}$")


class StageRecord(BaseModel):
    """What one stage of the fetched pipeline needs."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    files: tuple[str, ...]
    bytes: int


class Marker(BaseModel):
    """The completion marker of one revision in the cache."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: str = MARKER_VERSION
    repo: str
    revision: str
    sha: str
    endpoint: str | None = None
    completed_at: str
    # Every file of the repository at ``sha`` and its size; what each stage needs is worked out from it.
    repo_files: dict[str, int]
    # The files in the cache (the union over the stages of every fetch of this revision), with sizes.
    files: dict[str, int]
    stages: dict[str, StageRecord]

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    @property
    def repo_bytes(self) -> int:
        return sum(self.repo_files.values())


def default_cache_dir() -> Path:
    """The hub cache ``huggingface_hub`` uses in this environment (``HF_HUB_CACHE``, ``HF_HOME``...)."""
    try:
        from huggingface_hub import constants  # noqa: PLC0415  (optional dependency)

        return Path(constants.HF_HUB_CACHE)
    except ImportError:
        pass
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def views_root() -> Path:
    """Where stage views go: the temporary directory (writable in a pod, unlike a read-only cache)."""
    return Path(tempfile.gettempdir()) / "omnimodel-views"


def repo_key(repo: str) -> str:
    return repo.replace("/", "--")


def snapshot_dir(cache: Path, repo: str, sha: str) -> Path:
    return cache / f"models--{repo_key(repo)}" / "snapshots" / sha


def blobs_dir(cache: Path, repo: str) -> Path:
    return cache / f"models--{repo_key(repo)}" / "blobs"


def marker_dir(cache: Path, repo: str) -> Path:
    return cache / MARKER_DIR / repo_key(repo)


def marker_path(cache: Path, repo: str, sha: str) -> Path:
    return marker_dir(cache, repo) / f"{sha}.json"


def ref_path(cache: Path, repo: str, revision: str) -> Path:
    return marker_dir(cache, repo) / "refs" / quote(revision, safe="")


def hub_ref_path(cache: Path, repo: str, revision: str) -> Path:
    """huggingface_hub's ref of ``revision`` (``refs/pr/1`` nests, as huggingface_hub writes it)."""
    return cache / f"models--{repo_key(repo)}" / "refs" / revision


def error_path(cache: Path, repo: str) -> Path:
    return marker_dir(cache, repo) / "last-error.json"


def cached_sha(cache: Path, repo: str, revision: str) -> str | None:
    """The sha ``revision`` names without asking the Hub: itself when it is one, else the last fetch's."""
    if FULL_SHA.match(revision):
        return revision
    try:
        sha = ref_path(cache, repo, revision).read_text().strip()
    except OSError:
        return None
    return sha if FULL_SHA.match(sha) else None


def read_marker(cache: Path, repo: str, sha: str) -> Marker | None:
    try:
        return Marker.model_validate_json(marker_path(cache, repo, sha).read_bytes())
    except (OSError, ValueError):
        return None


def write_marker(cache: Path, marker: Marker) -> Path:
    path = marker_path(cache, marker.repo, marker.sha)
    _atomic_write(path, marker.model_dump_json(indent=2) + "\n")
    if marker.revision != marker.sha:
        _atomic_write(ref_path(cache, marker.repo, marker.revision), marker.sha + "\n")
        # huggingface_hub's own ref too (hf_hub_download by sha writes none), so a plain client offline
        # (vLLM-Omni's pods: `vllm serve org/name` with HF_HUB_OFFLINE) resolves the branch to this snapshot.
        _atomic_write(hub_ref_path(cache, marker.repo, marker.revision), marker.sha)
    with contextlib.suppress(OSError):
        error_path(cache, marker.repo).unlink()
    return path


def write_error(cache: Path, repo: str, revision: str, reason: str, message: str) -> None:
    """Record a failed fetch for waiters to show (best effort: the cache may be unwritable)."""
    data = {"revision": revision, "reason": reason, "message": message, "at": now_iso()}
    with contextlib.suppress(OSError):
        _atomic_write(error_path(cache, repo), json.dumps(data) + "\n")


def read_error(cache: Path, repo: str) -> dict[str, Any] | None:
    try:
        data = json.loads(error_path(cache, repo).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the marker from the stages' readers of the cache
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def fetch_lock(cache: Path, repo: str, sha: str) -> Iterator[None]:
    """One fetcher per revision at a time on this cache (others wait, then find the files there)."""
    path = marker_dir(cache, repo) / f".{sha}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def present(snapshot: Path, path: str, size: int | None) -> bool:
    """True when ``path`` is in the snapshot with the expected size (a symlink to a finished blob)."""
    try:
        st = (snapshot / path).stat()
    except OSError:
        return False
    return size is None or st.st_size == size


def missing_files(snapshot: Path, files: Mapping[str, int]) -> list[str]:
    return [path for path, size in sorted(files.items()) if not present(snapshot, path, size)]


def incomplete_bytes(cache: Path, repo: str) -> int:
    """Bytes of the downloads in flight (``huggingface_hub`` writes ``blobs/<etag>.incomplete``)."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(blobs_dir(cache, repo)):
            if entry.name.endswith(".incomplete"):
                with contextlib.suppress(OSError):
                    total += entry.stat().st_size
    return total


def stage_view(
    snapshot: Path,
    files: Sequence[str],
    *,
    label: str,
    index: str | None = None,
    prefixes: Sequence[str] = (),
    root: Path | None = None,
) -> Path:
    """A directory holding only ``files`` of ``snapshot`` (symlinks), which is all a stage can read.

    With tensor ``prefixes``, the checkpoint ``index`` in the view maps only those tensors (so a loader
    opens only the stage's shards, and a stage that downloaded only its shards finds every shard the
    index names). Views are shared by processes and kept: the same inputs give the same directory.
    """
    root = root or views_root()
    digest = hashlib.sha256(json.dumps([str(snapshot), sorted(files), index, list(prefixes)]).encode()).hexdigest()[:16]
    target = root / f"{label}-{digest}"
    if (target / VIEW_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the view from another user of the same /tmp
        for path in files:
            link = tmp / path
            link.parent.mkdir(parents=True, exist_ok=True)
            if index is not None and path == index and prefixes:
                data = json.loads((snapshot / path).read_text())
                weight_map = data.get("weight_map", {})
                data["weight_map"] = {k: v for k, v in weight_map.items() if k.startswith(tuple(prefixes))}
                link.write_text(json.dumps(data, indent=2) + "\n")
            else:
                os.symlink((snapshot / path).resolve(), link)
        (tmp / VIEW_MARKER).write_text(json.dumps({"snapshot": str(snapshot), "files": sorted(files)}) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / VIEW_MARKER).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process made the same view meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
