"""A real Hugging Face mirror on loopback: olah serving the test bed's tiny models over the Hub protocol.

``huggingface_hub`` (with ``HF_ENDPOINT`` pointing here) downloads from it exactly as from the Hub: revision
API, tree listing, ``resolve`` URLs, LFS files. olah runs from its own cached environment
(``e2e/hfmirror/setup-env``) as ``e2e/hfmirror/olah_server.py``, which adds what olah lacks for local
repositories: private repositories with tokens and an access log (bytes per file per request).

::

    mirror = HubMirror(tmp / "mirror", host="127.0.0.5").start()
    sha = mirror.publish(model_dir, "acme/tiny-t2i")          # a git commit on branch main
    mirror.require_token("acme/tiny-t2i", "hf_good")            # now private
    env = {"HF_ENDPOINT": mirror.url, "HF_TOKEN": "hf_good"}
    ...
    mirror.downloads(since=mark)                                # {file: bytes} of resolve GETs
    mirror.stop()                                               # by PID; HubMirror.attach(root) from elsewhere
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from omnimodel_testbed import procs

__all__ = [
    "AccessEntry",
    "HubMirror",
    "HubMirrorError",
    "downloaded_files",
    "ensure_env",
    "setup_script",
    "shard_by_prefix",
]

HERE: Final = Path(__file__).resolve().parent.parent / "hfmirror"
# Stored as LFS objects, as the Hub's default .gitattributes does for weights.
LFS_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npy", ".model", ".onnx", ".msgpack", ".h5")
LFS_MIN_BYTES: Final = 10 * 1024 * 1024
_GIT_ID: Final = ("-c", "user.name=omnimodel-testbed", "-c", "user.email=testbed@omnimodel.invalid")


class HubMirrorError(RuntimeError):
    """The mirror's environment could not be built, or the mirror did not start."""


def setup_script() -> Path:
    return HERE / "setup-env"


@functools.cache
def ensure_env() -> Path:
    """Directory of the mirror's environment, building it first if needed (about a minute, cold)."""
    return procs.setup_env(setup_script(), "bin/python", HubMirrorError)


@dataclass(frozen=True)
class AccessEntry:
    """One request the mirror answered."""

    method: str
    path: str
    status: int
    bytes: int
    repo: str | None
    revision: str | None
    file: str | None
    token: str  # none, valid or invalid
    refused: bool = False

    @property
    def is_download(self) -> bool:
        """A file's bytes were sent (a GET of a resolve URL that succeeded)."""
        return self.method == "GET" and self.file is not None and 200 <= self.status < 300


class HubMirror:
    """olah on ``host:port`` (loopback) serving the git repositories under ``root/mirrors/models``."""

    def __init__(self, root: Path, *, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.root = root.resolve()
        self.host = host
        self.port = port or procs.free_ports(1)[0]
        self.record: procs.ProcessRecord | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def access_log_path(self) -> Path:
        return self.root / "access.jsonl"

    # ------------------------------------------------------------ process

    def start(self, *, timeout: float = 60.0) -> HubMirror:
        env_dir = ensure_env()
        self.root.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON"))}
        self.record = procs.start(
            f"hfmirror-{self.port}",
            [
                str(env_dir / "bin" / "python"),
                str(HERE / "olah_server.py"),
                "--root",
                str(self.root),
                "--host",
                self.host,
                "--port",
                str(self.port),
            ],
            self.root / "olah.log",
            env=env,
            cwd=self.root,
        )
        try:
            procs.wait_until(
                f"the mirror on {self.url}", self._answers, timeout=timeout, interval=0.2, watch=[self.record]
            )
        except BaseException:
            self.stop()  # never leave a mirror running that nobody holds a record of
            raise
        state = {"host": self.host, "port": self.port, "url": self.url, "process": self.record.to_json()}
        (self.root / "mirror.json").write_text(json.dumps(state, indent=2) + "\n")
        return self

    @classmethod
    def attach(cls, root: Path) -> HubMirror:
        """The mirror another process started on ``root`` (from ``root/mirror.json``), to use or stop it."""
        state = json.loads((root / "mirror.json").read_text())
        mirror = cls(root, host=state["host"], port=int(state["port"]))
        mirror.record = procs.ProcessRecord.from_json(state["process"])
        return mirror

    @property
    def running(self) -> bool:
        return self.record is not None and procs.is_alive(self.record)

    def _answers(self) -> bool:
        """Any answer below 500 from olah (an absent repository is a 401, as on the Hub)."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/models/omnimodel-testbed/absent", timeout=2):
                return True
        except urllib.error.HTTPError as err:
            return err.code < 500

    def stop(self) -> None:
        """Stop the mirror by its PID (checked against the recorded start time, never another process)."""
        if self.record is not None:
            procs.stop([self.record], grace=5.0)
            self.record = None
            (self.root / "mirror.json").unlink(missing_ok=True)

    def __enter__(self) -> HubMirror:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ repositories

    def repo_dir(self, repo: str) -> Path:
        org, name = repo.split("/", 1)
        return self.root / "mirrors" / "models" / org / name

    def publish(self, model_dir: Path, repo: str, *, revision: str = "main", message: str | None = None) -> str:
        """Commit ``model_dir``'s files as ``repo`` on branch ``revision`` (created, or a new commit on
        top); weights become LFS objects as on the Hub. Returns the commit sha."""
        git_dir = self.repo_dir(repo)
        if not (git_dir / ".git").is_dir():
            git_dir.mkdir(parents=True, exist_ok=True)
            _git(git_dir, "init", "-q", "-b", revision)
        branches = _git(git_dir, "branch", "--list", revision).strip()
        has_commits = _git(git_dir, "rev-parse", "--verify", "-q", "HEAD", check=False).strip() != ""
        if branches:
            _git(git_dir, "checkout", "-q", revision)
        elif has_commits:
            _git(git_dir, "checkout", "-q", "--orphan", revision)
        for entry in git_dir.iterdir():
            if entry.name != ".git":
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        attributes = [f"*{suffix} filter=lfs diff=lfs merge=lfs -text" for suffix in LFS_SUFFIXES]
        for src in sorted(p for p in model_dir.rglob("*") if p.is_file()):
            rel = src.relative_to(model_dir)
            dst = git_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            size = src.stat().st_size
            if src.suffix in LFS_SUFFIXES or size >= LFS_MIN_BYTES:
                oid = _sha256(src)
                obj = git_dir / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
                obj.parent.mkdir(parents=True, exist_ok=True)
                if not obj.exists():
                    shutil.copyfile(src, obj)
                dst.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n")
                if src.suffix not in LFS_SUFFIXES:
                    attributes.append(f"{rel.as_posix()} filter=lfs diff=lfs merge=lfs -text")
            else:
                shutil.copyfile(src, dst)
        (git_dir / ".gitattributes").write_text("\n".join(attributes) + "\n")
        _git(git_dir, "add", "-A")
        _git(git_dir, *_GIT_ID, "commit", "-q", "--allow-empty", "-m", message or f"publish {model_dir.name}")
        return _git(git_dir, "rev-parse", "HEAD").strip()

    def tag(self, repo: str, tag: str, revision: str = "main") -> str:
        git_dir = self.repo_dir(repo)
        _git(git_dir, "tag", "-f", tag, revision)
        return _git(git_dir, "rev-parse", f"{tag}^{{commit}}").strip()

    def files(self, repo: str, revision: str = "main") -> dict[str, int]:
        """The repository's files at ``revision`` with their real sizes (LFS objects at theirs)."""
        git_dir = self.repo_dir(repo)
        out: dict[str, int] = {}
        for line in _git(git_dir, "ls-tree", "-r", "-l", revision).splitlines():
            meta, path = line.split("\t", 1)
            size = int(meta.split()[3])
            blob = _git(git_dir, "cat-file", "-p", meta.split()[2]) if 120 < size < 150 else ""
            if blob.startswith("version https://git-lfs.github.com/spec/v1"):
                size = int(blob.split("size ", 1)[1].split()[0])
            out[path] = size
        return out

    # ------------------------------------------------------------ access control and speed

    def _control(self) -> dict[str, Any]:
        path = self.root / "control.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _write_control(self, data: Mapping[str, Any]) -> None:
        path = self.root / "control.json"
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)

    def require_token(self, repo: str, *tokens: str) -> None:
        """Make ``repo`` private: only requests carrying one of ``tokens`` see it (as the Hub answers)."""
        data = self._control()
        data.setdefault("private", {})[repo] = list(tokens)
        self._write_control(data)

    def make_public(self, repo: str) -> None:
        data = self._control()
        data.get("private", {}).pop(repo, None)
        self._write_control(data)

    def set_rate(self, bytes_per_s: int | None) -> None:
        """Throttle every response body to ``bytes_per_s`` (None: full speed)."""
        data = self._control()
        data["rate_bytes_per_s"] = bytes_per_s
        self._write_control(data)

    # ------------------------------------------------------------ access log

    def log_mark(self) -> int:
        """A position in the access log; pass it as ``since`` to read only later requests."""
        return self.access_log_path.stat().st_size if self.access_log_path.exists() else 0

    def access_log(self, since: int = 0) -> list[AccessEntry]:
        if not self.access_log_path.exists():
            return []
        with self.access_log_path.open("rb") as fh:
            fh.seek(since)
            data = fh.read().decode()
        entries = []
        for line in data.splitlines():
            raw = json.loads(line)
            entries.append(
                AccessEntry(
                    method=raw["method"],
                    path=raw["path"],
                    status=int(raw.get("status", 0)),
                    bytes=int(raw.get("bytes", 0)),
                    repo=raw.get("repo"),
                    revision=raw.get("revision"),
                    file=raw.get("file"),
                    token=raw.get("token", "none"),
                    refused=bool(raw.get("refused", False)),
                )
            )
        return entries

    def downloads(self, since: int = 0, repo: str | None = None) -> dict[str, int]:
        """Bytes of file content sent per file since ``since`` (summed over requests)."""
        total: Counter[str] = Counter()
        for entry in self.access_log(since):
            if entry.is_download and (repo is None or entry.repo == repo):
                assert entry.file is not None
                total[entry.file] += entry.bytes
        return dict(total)


def _git(cwd: Path, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise HubMirrorError(f"git {' '.join(args)} in {cwd} failed: {proc.stderr.strip()}")
    return proc.stdout


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- re-sharding a checkpoint


def shard_by_prefix(src: Path, dst: Path, prefixes: Sequence[str], *, checkpoint: str = "model.safetensors") -> Path:
    """Copy the model in ``src`` to ``dst`` with its single safetensors ``checkpoint`` split into one shard
    per tensor prefix (in order; tensors matching none go into a last shard) plus the
    ``model.safetensors.index.json`` a sharded ``save_pretrained`` writes. Byte-exact tensors, no torch."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.rglob("*"):
        if path.is_file() and path.name != checkpoint:
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    header, data = _read_safetensors(src / checkpoint)
    metadata = header.pop("__metadata__", None)
    groups: list[list[str]] = [[] for _ in range(len(prefixes) + 1)]
    for name in header:
        slot = next((i for i, p in enumerate(prefixes) if name.startswith(p)), len(prefixes))
        groups[slot].append(name)
    groups = [g for g in groups if g]
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(groups, 1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (header[n], data[header[n]["data_offsets"][0] : header[n]["data_offsets"][1]]) for n in names}
        total += _write_safetensors(dst / shard, tensors, metadata)
        weight_map.update(dict.fromkeys(names, shard))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return dst


def _read_safetensors(path: Path) -> tuple[dict[str, Any], memoryview]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    return header, memoryview(raw)[8 + length :]


def _write_safetensors(path: Path, tensors: Mapping[str, tuple[Mapping[str, Any], memoryview]], metadata: Any) -> int:
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (info, blob) in tensors.items():
        header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(encoded)))
        fh.write(encoded)
        for _info, blob in tensors.values():
            fh.write(blob)
    return offset


def downloaded_files(entries: Iterable[AccessEntry]) -> set[str]:
    """The files whose bytes were sent in ``entries``."""
    return {e.file for e in entries if e.is_download and e.file is not None}
