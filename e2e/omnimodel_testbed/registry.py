"""The test bed's OCI registry: the CNCF distribution registry, built from its Go module with the control
plane's binaries (``e2e/cluster/registry``), serving one storage directory.

``make images`` pushes the operator and runtime images into that storage through a registry it starts for
the push (``push_images``); every test-bed cluster starts its own registry over the same storage with the
control plane, on a port of its own inside its network, so the images pushed once are served by every
cluster after. The pod runner pulls from it over plain HTTP, as a kubelet pulls from a registry its
containerd is told is insecure; nothing here talks to any other registry.

Image names: what ``make images`` builds is ``<REGISTRY>/omnimodel-operator:<version>`` and
``<REGISTRY>/omnimodel-runtime:<version>-<variant>`` (``REGISTRY`` defaults to ``ghcr.io/omnimodel``); in
the test bed the same repositories live under ``127.0.0.1:<port>/omnimodel/``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import yaml

from . import procs
from .binaries import cache_root, ensure_built

if TYPE_CHECKING:
    from .cluster import ClusterState

__all__ = [
    "NAMESPACE",
    "REGISTRY_ENV",
    "RegistryImages",
    "push_images",
    "registry_config",
    "registry_storage",
    "running_registry",
    "wait_ready",
]

log = logging.getLogger("omnimodel_testbed")

#: The repository namespace every image of ours has in the test bed's registry (ghcr.io/omnimodel/... upstream).
NAMESPACE: Final = "omnimodel"


def registry_storage() -> Path:
    """Where the registry keeps blobs and manifests: ``$OMNIMODEL_REGISTRY_STORAGE`` or ``<cache>/registry``."""
    env = os.environ.get("OMNIMODEL_REGISTRY_STORAGE")
    return Path(env) if env else cache_root() / "registry"


def registry_config(storage: Path, port: int, path: Path) -> Path:
    """Write the registry's configuration: filesystem storage, loopback HTTP, deletes allowed (a test may
    remove a tag), no access log (every layer request would be a line)."""
    config = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


#: The registry (v3) exports OpenTelemetry traces to localhost:4318 unless told not to.
REGISTRY_ENV: Final = {"OTEL_TRACES_EXPORTER": "none"}


def wait_ready(port: int, watch: Sequence[procs.ProcessRecord] = (), timeout: float = 30) -> None:
    """Until ``/v2/`` answers 200 (the distribution API's version check)."""
    from .kubeapi import http_get

    procs.wait_until(
        "registry /v2/",
        lambda: http_get("127.0.0.1", port, "/v2/", tls=False) == 200,
        timeout=timeout,
        watch=list(watch),
    )


@contextmanager
def running_registry(workdir: Path) -> Iterator[int]:
    """A registry over the shared storage for as long as the block runs; yields its port."""
    toolchain = ensure_built()
    storage = registry_storage()
    storage.mkdir(parents=True, exist_ok=True)
    port = procs.free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    config = registry_config(storage, port, workdir / "registry.yaml")
    rec = procs.start(
        "registry",
        [str(toolchain.path("registry")), "serve", str(config)],
        workdir / "registry.log",
        env={**os.environ, **REGISTRY_ENV},
    )
    try:
        wait_ready(port, [rec])
        yield port
    finally:
        procs.stop([rec])


@dataclass(frozen=True)
class RegistryImages:
    """The references of our images in a test-bed registry at ``127.0.0.1:<port>``."""

    port: int
    version: str

    @property
    def prefix(self) -> str:
        return f"127.0.0.1:{self.port}/{NAMESPACE}"

    @property
    def operator(self) -> str:
        return f"{self.prefix}/omnimodel-operator:{self.version}"

    def runtime(self, variant: str = "cpu") -> str:
        return f"{self.prefix}/omnimodel-runtime:{self.version}-{variant}"

    def runtime_images(self) -> dict[str, str]:
        """Every accelerator vendor's runtime image: the CPU one, since the fake nodes have no devices and
        every stage runs on this machine's CPU whatever vendor the scheduler placed it on."""
        from omnimodel_operator.accelerators import ACCELERATORS

        return {vendor.value: self.runtime("cpu") for vendor in ACCELERATORS}

    def chart_values(self) -> list[str]:
        """helm ``--set`` flags that point the chart at these images, through its own values: the
        operator's repository and the runtime repository, whose ``-cpu`` tag the chart computes for vendor
        cpu, and ``runtime.images`` for the others."""
        flags = [
            f"--set=image.repository={self.prefix}/omnimodel-operator",
            f"--set=runtime.repository={self.prefix}/omnimodel-runtime",
        ]
        flags += [f"--set=runtime.images.{v}={image}" for v, image in self.runtime_images().items() if v != "cpu"]
        return flags

    @classmethod
    def of(cls, state: ClusterState) -> RegistryImages:
        """The images in ``state``'s cluster's registry, at the version this checkout builds."""
        from omnimodel_operator import __version__

        return cls(state.ports["registry"], __version__)


def _buildah() -> str:
    path = shutil.which("buildah")
    if path is None:
        raise RuntimeError("`buildah` not found: run .ci/setup-image-tools (or apt-get install buildah)")
    return path


def push_images(names: Sequence[str], workdir: Path) -> list[str]:
    """Push locally built images (buildah's storage) into the test bed's registry storage, under the same
    repository name under ``omnimodel/``; returns the test-bed references, each with its manifest digest."""
    pushed = []
    with running_registry(workdir) as port:
        for name in names:
            # <any registry>/<path>/omnimodel-runtime:0.1.0-cpu → 127.0.0.1:<port>/omnimodel/omnimodel-runtime:0.1.0-cpu
            target = f"127.0.0.1:{port}/{NAMESPACE}/{name.rsplit('/', 1)[-1]}"
            digest_file = workdir / "digest"
            subprocess.run(
                [
                    _buildah(), "push", "--quiet", "--tls-verify=false", "--digestfile", str(digest_file),
                    name, f"docker://{target}",
                ],
                check=True,
            )  # fmt: skip
            digest = digest_file.read_text().strip()
            log.info("pushed %s to the test bed's registry as %s@%s", name, target, digest)
            pushed.append(f"{target}@{digest}")
    return pushed
