"""The Hugging Face Hub through the real ``huggingface_hub`` client, and why a call failed.

The client reads ``HF_ENDPOINT`` (a mirror) and ``HF_TOKEN`` from the environment itself; nothing here
passes or logs a token. Failures become a :class:`WeightsError` with one of :data:`REASONS`, the word the
operator's ``WeightsReady`` condition and the fetch container's termination message carry.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Final

from omnimodel_runtime.errors import ExtraMissingError, ModelSourceError

# Why a fetch failed, as one word.
UNAUTHORIZED: Final = "Unauthorized"  # 401/403: the token was rejected, or it has no access (gated repo)
NOT_FOUND: Final = "NotFound"  # 404 (or the Hub's 401 for a repository it will not show): repo/revision/file
NO_SPACE: Final = "NoSpace"  # the cache volume is full (ENOSPC/EDQUOT), or too small for what is missing
NETWORK: Final = "Network"  # the endpoint cannot be reached or timed out
RATE_LIMITED: Final = "RateLimited"  # 429
HUB_ERROR: Final = "HubError"  # any other HTTP error status from the endpoint
INVALID: Final = "Invalid"  # the pipeline's file sets do not fit the repository
FAILED: Final = "Failed"  # anything else
REASONS: Final = (UNAUTHORIZED, NOT_FOUND, NO_SPACE, NETWORK, RATE_LIMITED, HUB_ERROR, INVALID, FAILED)
# Failures a retry cannot fix (the others may pass on a second try).
PERMANENT: Final = frozenset({UNAUTHORIZED, NOT_FOUND, NO_SPACE, INVALID})


class WeightsError(ModelSourceError):
    """Weights could not be fetched or found; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        self.message = " ".join(message.split())  # one line
        super().__init__(f"{reason}: {self.message}")


def _hf() -> Any:
    try:
        import huggingface_hub  # noqa: PLC0415  (optional dependency)
        import huggingface_hub.constants  # noqa: PLC0415
        import huggingface_hub.hf_api  # noqa: PLC0415
        from huggingface_hub.utils.tqdm import disable_progress_bars  # noqa: PLC0415
    except ImportError as err:
        raise ExtraMissingError(what="hf:// model sources", extra="transformers", cause=err) from err
    disable_progress_bars()  # our own progress lines replace them
    return huggingface_hub


def endpoint() -> str:
    """The Hub endpoint the client talks to (``HF_ENDPOINT`` or huggingface.co)."""
    return str(_hf().constants.ENDPOINT)


def offline() -> bool:
    """``HF_HUB_OFFLINE``: the client may not reach the Hub at all."""
    return bool(_hf().constants.HF_HUB_OFFLINE)


def _token_note() -> str:
    return "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set"


def resolve_revision(repo: str, revision: str) -> str:
    """The commit sha ``revision`` (a branch, tag or sha) of model ``repo`` names."""
    hf = _hf()
    api = hf.HfApi()
    try:
        info = api.model_info(repo, revision=revision)
    except Exception as err:
        failure = classify(err, repo=repo, revision=revision)
        if failure.reason == NOT_FOUND and _hides_revision(api, repo, revision, err):
            raise WeightsError(NOT_FOUND, f"revision {revision!r} not found in {repo} at {endpoint()}") from err
        raise failure from err
    sha = getattr(info, "sha", None)
    if not sha:
        raise WeightsError(HUB_ERROR, f"{endpoint()} gave no commit sha for {repo}@{revision}")
    return str(sha)


def _hides_revision(api: Any, repo: str, revision: str, err: BaseException) -> bool:
    """A repository-level "not found" for a revision while the repository itself is visible means the
    revision is what is missing (some mirrors answer a missing revision as the Hub does a hidden repo)."""
    if type(err).__name__ != "RepositoryNotFoundError" or revision == "main":
        return False
    try:
        api.model_info(repo, revision="main")
    except Exception:
        return False
    return True


def list_files(repo: str, sha: str) -> dict[str, int]:
    """Every file of ``repo`` at ``sha`` and its size in bytes (LFS files at their real size)."""
    hf = _hf()
    try:
        entries = list(hf.HfApi().list_repo_tree(repo, revision=sha, recursive=True))
    except Exception as err:
        raise classify(err, repo=repo, revision=sha) from err
    files: dict[str, int] = {}
    for entry in entries:
        if isinstance(entry, hf.hf_api.RepoFile):
            lfs = getattr(entry, "lfs", None)
            size = getattr(lfs, "size", None) if lfs is not None else None
            files[entry.path] = int(size if size is not None else entry.size)
    return files


def download_file(repo: str, sha: str, path: str, cache: Path) -> Path:
    """One file of ``repo`` at ``sha`` into the hub cache ``cache``; the snapshot path of it."""
    hf = _hf()
    try:
        return Path(hf.hf_hub_download(repo, path, revision=sha, cache_dir=str(cache)))
    except Exception as err:
        raise classify(err, repo=repo, revision=sha, path=path) from err


def local_snapshot(repo: str, revision: str) -> Path:
    """The snapshot of ``repo`` a pre-filled cache holds, without the network (``HF_HUB_OFFLINE``)."""
    hf = _hf()
    try:
        return Path(hf.snapshot_download(repo_id=repo, revision=revision, local_files_only=True))
    except Exception as err:
        raise WeightsError(NOT_FOUND, f"{repo}@{revision} is not in the local cache and the Hub is offline") from err


def classify(err: BaseException, *, repo: str, revision: str, path: str | None = None) -> WeightsError:
    """Why ``err`` happened, as a :class:`WeightsError` (walking the ``__cause__`` chain)."""
    if isinstance(err, WeightsError):
        return err
    where = f"{repo}@{revision}" + (f" file {path}" if path else "")
    chain = _chain(err)
    names = {type(e).__name__ for e in chain}
    for e in chain:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return WeightsError(NO_SPACE, f"the cache volume is full while writing {where}: {e}")
        if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return WeightsError(FAILED, f"the cache is not writable ({e}) while fetching {where}")
    status = next((s for s in (_status(e) for e in chain) if s is not None), None)
    detail = _server_message(chain)
    if "GatedRepoError" in names:
        return WeightsError(
            UNAUTHORIZED,
            f"{repo} is gated and the token has not been granted access (HTTP {status or 403}; {_token_note()})",
        )
    if "RevisionNotFoundError" in names:
        return WeightsError(NOT_FOUND, f"revision {revision!r} not found in {repo} at {endpoint()}")
    if names & {"EntryNotFoundError", "RemoteEntryNotFoundError"}:
        return WeightsError(NOT_FOUND, f"file {path!r} not found in {repo}@{revision}")
    if "RepositoryNotFoundError" in names:
        return WeightsError(
            NOT_FOUND,
            f"repository {repo} not found at {endpoint()} (HTTP {status}; a private repository looks the same "
            f"without a token that may see it; {_token_note()})",
        )
    if status in (401, 403):
        return WeightsError(
            UNAUTHORIZED,
            f"{endpoint()} refused {where} (HTTP {status}{': ' + detail if detail else ''}; {_token_note()})",
        )
    if status == 404:
        return WeightsError(NOT_FOUND, f"{where} not found at {endpoint()} (HTTP 404)")
    if status == 429:
        return WeightsError(RATE_LIMITED, f"{endpoint()} rate-limited the fetch of {where} (HTTP 429)")
    if status is not None:
        return WeightsError(HUB_ERROR, f"{endpoint()} answered HTTP {status} for {where}")
    if _is_network(chain):
        return WeightsError(NETWORK, f"cannot reach {endpoint()} for {where}: {_last_words(chain)}")
    return WeightsError(FAILED, f"fetching {where} failed: {type(err).__name__}: {err}")


def _chain(err: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in out and len(out) < 16:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _status(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    code = getattr(response, "status_code", None)
    return int(code) if isinstance(code, int) else None


def _server_message(chain: list[BaseException]) -> str:
    for e in chain:
        response = getattr(e, "response", None)
        headers = getattr(response, "headers", None)
        if headers is not None:
            message = headers.get("X-Error-Message")
            if message:
                return str(message)
    return ""


def _is_network(chain: list[BaseException]) -> bool:
    network_words = ("ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout", "NetworkError", "RemoteProtocol")
    for e in chain:
        name = type(e).__name__
        if isinstance(e, (ConnectionError, TimeoutError)) or any(w in name for w in network_words):
            return True
        if name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled"):
            return True
    return False


def _last_words(chain: list[BaseException]) -> str:
    last = chain[-1]
    return f"{type(last).__name__}: {last}"[:300]
