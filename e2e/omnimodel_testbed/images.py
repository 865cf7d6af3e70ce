"""Pull and unpack container images, as a node's container runtime does, for the pod runner.

An image is pulled by reference from the test bed's registry with skopeo (the manifest's digest pinned
first, so every blob skopeo copies is checked against the digest that names it) into one OCI layout that
all images share, then its root filesystem is unpacked once per manifest digest with umoci (``raw
unpack``: the layers applied in order, whiteouts honoured) into ``<cache>/images/rootfs/<digest>``, kept
across test runs. A container runs on an overlay of that directory (``kubelet.py``), so the unpacked
image is never written to.

Which reference has which digest is the node's own record (``refs.json`` under the cluster's state
directory): a new cluster is a new node that has pulled nothing yet, and ``imagePullPolicy`` decides as
the kubelet does: ``Always`` asks the registry for the tag's digest on every start, ``IfNotPresent`` uses
the node's record when it has one, ``Never`` fails with ``ErrImageNeverPull`` without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final

from .binaries import cache_root

__all__ = ["Image", "ImagePullError", "ImageStore", "image_user"]

log = logging.getLogger("omnimodel_testbed")

_MANIFEST_TYPES: Final = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
_INDEX_TYPES: Final = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)


#: How many unpacked images the cache keeps (the newest, and always those the node's records name).
KEEP_UNPACKED: Final = 3


class ImagePullError(RuntimeError):
    """An image could not be pulled; ``reason`` is the kubelet's (``ErrImagePull``, ``ErrImageNeverPull``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Image:
    """A pulled, unpacked image: its manifest digest, root filesystem and configuration."""

    reference: str
    digest: str
    rootfs: Path
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def image_id(self) -> str:
        """``containerStatuses[].imageID``: the repository with the manifest digest, as containerd reports."""
        repository = _split(self.reference)[0]
        return f"{repository}@{self.digest}"

    @property
    def env(self) -> list[str]:
        return list(self.config.get("Env") or [])

    @property
    def entrypoint(self) -> list[str]:
        return list(self.config.get("Entrypoint") or [])

    @property
    def cmd(self) -> list[str]:
        return list(self.config.get("Cmd") or [])

    @property
    def working_dir(self) -> str:
        return str(self.config.get("WorkingDir") or "/")

    @property
    def user(self) -> str:
        return str(self.config.get("User") or "")


def _split(reference: str) -> tuple[str, str]:
    """``host:port/repo:tag`` or ``…@sha256:…`` → (repository, tag or digest)."""
    if "@" in reference:
        repository, digest = reference.split("@", 1)
        return repository, digest
    slash = reference.rfind("/")
    colon = reference.rfind(":")
    if colon > slash:
        return reference[:colon], reference[colon + 1 :]
    return reference, "latest"


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise ImagePullError("ErrImagePull", f"`{name}` not found on this node: apt-get install skopeo umoci")
    return path


# skopeo and umoci report errors as logrus lines (time="..." level=fatal msg="..."): keep the message.
_LOG_PREFIX = re.compile(r"^time=\"[^\"]*\" level=\w+ msg=", re.MULTILINE)


def _run(argv: Sequence[str]) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        message = _LOG_PREFIX.sub("", (result.stderr or result.stdout).strip()).strip('"')
        raise ImagePullError("ErrImagePull", message or f"{argv[0]} exited with {result.returncode}")
    return result.stdout


class ImageStore:
    """The images of one node: pulled into ``cache`` (shared by every node and run), recorded in ``refs``."""

    #: One pull at a time in this process, whichever store: they share the cache's OCI layout.
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, refs: Path, cache: Path | None = None) -> None:
        self.cache = cache or cache_root() / "images"
        self.layout = self.cache / "oci"
        self.rootfs_dir = self.cache / "rootfs"
        self.refs = refs

    def _records(self) -> dict[str, str]:
        try:
            data = json.loads(self.refs.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return {str(k): str(v) for k, v in data.items()}

    def _remember(self, reference: str, digest: str) -> None:
        records = self._records()
        records[reference] = digest
        self.refs.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.refs.with_suffix(".tmp")
        tmp.write_text(json.dumps(records, indent=2, sort_keys=True))
        tmp.replace(self.refs)

    def present(self, reference: str) -> str | None:
        """The digest this node pulled for ``reference``, if it did and still has it unpacked."""
        digest = self._records().get(reference)
        if digest and (self.rootfs_dir / digest.replace(":", "-")).is_dir():
            return digest
        return None

    def remote_digest(self, reference: str) -> str:
        """The manifest digest the registry serves for ``reference`` (for an index: its linux/amd64 entry)."""
        raw = _run([_tool("skopeo"), "inspect", "--raw", "--tls-verify=false", f"docker://{reference}"])
        manifest = json.loads(raw)
        if manifest.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:
            for entry in manifest.get("manifests", []):
                platform = entry.get("platform") or {}
                if platform.get("os") == "linux" and platform.get("architecture") == "amd64":
                    return str(entry["digest"])
            raise ImagePullError("ErrImagePull", f"{reference}: no linux/amd64 image in its index")
        # The registry names a manifest by the SHA-256 of its exact bytes.
        return "sha256:" + hashlib.sha256(raw.encode()).hexdigest()

    def pull(self, reference: str, policy: str) -> Image:
        """The image for ``reference`` under ``policy``, pulled and unpacked if need be (ImagePullError if
        it cannot be); serialised, so two pods of one image pull it once."""
        with self._lock:
            local = self.present(reference)
            if policy == "Never":
                if local is None:
                    raise ImagePullError(
                        "ErrImageNeverPull",
                        f'Container image "{reference}" is not present with pull policy of Never',
                    )
                return self._image(reference, local)
            if policy == "IfNotPresent" and local is not None:
                return self._image(reference, local)
            digest = self.remote_digest(reference)
            if not self._unpacked(digest).is_dir():
                self._fetch(reference, digest)
            self._remember(reference, digest)
            return self._image(reference, digest)

    def _unpacked(self, digest: str) -> Path:
        return self.rootfs_dir / digest.replace(":", "-")

    def _fetch(self, reference: str, digest: str) -> None:
        repository = _split(reference)[0]
        tag = digest.replace(":", "-")
        self.layout.parent.mkdir(parents=True, exist_ok=True)
        _run(
            [
                _tool("skopeo"), "copy", "--quiet", "--src-tls-verify=false",
                f"docker://{repository}@{digest}", f"oci:{self.layout}:{tag}",
            ]
        )  # fmt: skip
        target = self._unpacked(digest)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.rootfs_dir.mkdir(parents=True, exist_ok=True)
        _run([_tool("umoci"), "raw", "unpack", "--image", f"{self.layout}:{tag}", str(partial)])
        # The config beside the root filesystem, so a later start reads one file.
        (partial.parent / f"{target.name}.config.json").write_text(json.dumps(self._config_of(tag)))
        partial.rename(target)
        self._prune(keep=target)

    def _prune(self, keep: Path) -> None:
        """Unpacked images beyond the KEEP_UNPACKED most recently used go (1.5 GB each for the runtime; a
        source change makes a new one). Never one a container of this node runs on: only those unpacked
        before the node's oldest record could be, and the records name what this node uses."""
        in_use = {self._unpacked(d) for d in self._records().values()} | {keep}
        unpacked = sorted(
            (p for p in self.rootfs_dir.iterdir() if p.is_dir() and not p.name.endswith(".partial")),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        for old in unpacked[KEEP_UNPACKED:]:
            if old not in in_use:
                shutil.rmtree(old, ignore_errors=True)
                old.with_name(f"{old.name}.config.json").unlink(missing_ok=True)
                log.info("removed the unpacked image %s (more than %d kept)", old.name, KEEP_UNPACKED)

    def _blob(self, digest: str) -> dict[str, Any]:
        algorithm, hexdigest = digest.split(":", 1)
        data: dict[str, Any] = json.loads((self.layout / "blobs" / algorithm / hexdigest).read_text())
        return data

    def _config_of(self, tag: str) -> dict[str, Any]:
        index = json.loads((self.layout / "index.json").read_text())
        for entry in index.get("manifests", []):
            if (entry.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag:
                manifest = self._blob(entry["digest"])
                config = self._blob(manifest["config"]["digest"])
                return dict(config.get("config") or {})
        raise ImagePullError("ErrImagePull", f"{tag} is not in the node's image layout")

    def _image(self, reference: str, digest: str) -> Image:
        rootfs = self._unpacked(digest)
        rootfs.touch()  # used now: the prune keeps the most recently used
        config = json.loads((rootfs.parent / f"{rootfs.name}.config.json").read_text())
        return Image(reference, digest, rootfs, config)


def _passwd(rootfs: Path, user: str) -> tuple[int, int] | None:
    """(uid, gid) of ``user`` (a name or a uid) in the image's /etc/passwd."""
    try:
        lines = (rootfs / "etc" / "passwd").read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        fields = line.split(":")
        if len(fields) > 3 and user in (fields[0], fields[2]) and fields[2].isdigit() and fields[3].isdigit():
            return int(fields[2]), int(fields[3])
    return None


def _group(rootfs: Path, group: str) -> int | None:
    try:
        lines = (rootfs / "etc" / "group").read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        fields = line.split(":")
        if len(fields) > 2 and fields[0] == group and fields[2].isdigit():
            return int(fields[2])
    return None


def image_user(image: Image, run_as_user: int | None, run_as_group: int | None) -> tuple[int, int]:
    """(uid, gid) a container runs as: the pod's ``runAsUser``/``runAsGroup`` where set, else the image's
    ``USER`` as runc reads it (a number or a name from the image's /etc/passwd; without a group, the
    user's primary group there, else 0), else root."""
    user, _, group = image.user.partition(":")
    uid = gid = 0
    if user:
        entry = _passwd(image.rootfs, user)
        if entry is None and not user.isdigit():
            raise ImagePullError("CreateContainerConfigError", f"unable to find user {user}: no matching entries")
        uid, gid = entry if entry is not None else (int(user), 0)
    if group:
        found = int(group) if group.isdigit() else _group(image.rootfs, group)
        if found is None:
            raise ImagePullError("CreateContainerConfigError", f"unable to find group {group}: no matching entries")
        gid = found
    if run_as_user is not None:
        uid = run_as_user
    if run_as_group is not None:
        gid = run_as_group
    return uid, gid
