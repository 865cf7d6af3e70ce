"""The local control plane: etcd, kube-apiserver, controller-manager, scheduler, kwok.

Everything listens on 127.0.0.1 on ports picked at start; nothing needs
root, a container engine or the network. State (PKI, etcd data, logs, PIDs,
ports) lives in one directory so another process (``python -m
omnimodel_testbed down``) can find and stop what ``up`` started.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from . import procs
from .binaries import Toolchain, cache_root, ensure_built
from .kubeapi import ApiError, KubeAPI, http_get
from .nodes import DEFAULT_FLEET, KWOK_ANNOTATION, AcceleratorSpecLike, FakeNode, build_nodes
from .pki import FRONT_PROXY_CLIENT, PKI, generate_pki
from .registry import REGISTRY_ENV, registry_config, registry_storage
from .registry import wait_ready as wait_registry
from .runnerpods import install_admission_policy, kwok_stages

__all__ = ["POD_CIDR", "Cluster", "ClusterError", "ClusterState", "default_pod_cidr", "default_state_dir"]

log = logging.getLogger("omnimodel_testbed")

SERVICE_CIDR = "10.96.0.0/16"
#: First IP of SERVICE_CIDR: the ``kubernetes`` Service's ClusterIP (in the serving cert).
SERVICE_IP = "10.96.0.1"
#: Default pod CIDR: loopback, so a test can run a pod's command as a local
#: process bound to the pod IP without any privileges. Caveat: EndpointSlice
#: and Endpoints validation reject loopback addresses, so Services selecting
#: such pods get no endpoints (the controller-manager retries and emits
#: FailedToUpdateEndpointSlices events). For real EndpointSlices use a
#: non-loopback CIDR routed to ``lo`` (see ``netns.py`` / ``python -m
#: omnimodel_testbed netns``) via ``OMNIMODEL_TESTBED_POD_CIDR``.
POD_CIDR = "127.100.0.0/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
CONTEXT = "omnimodel-testbed"
STATE_VERSION = 1

# Everything the harness creates inside a state dir; only these are ever
# deleted, so pointing state_dir at an existing directory is not destructive.
_OWNED = (
    "state.json",
    "admin.kubeconfig",
    "pki",
    "etcd-data",
    "logs",
    "kwok",
    "controller-manager",
    "scheduler",
    "apiserver",
    "registry.yaml",
    "images",
)

_COMPONENT_ORDER = ("etcd", "registry", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


#: The ``kubernetes`` Service's port, where in-cluster clients look for the API server.
KUBERNETES_SERVICE_PORT = 443


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ClusterError(RuntimeError):
    """The cluster could not be started or is not in the expected state."""


def default_pod_cidr() -> str:
    """``$OMNIMODEL_TESTBED_POD_CIDR`` or :data:`POD_CIDR`."""
    return os.environ.get("OMNIMODEL_TESTBED_POD_CIDR") or POD_CIDR


def _check_pod_cidr(cidr: str) -> None:
    """Reject a malformed CIDR; warn when its addresses are not local to this host.

    The cluster works either way, but a harness can only serve a pod's
    traffic from a local process if the pod IP is bindable here.
    """
    try:
        net = ipaddress.ip_network(cidr)
    except ValueError as exc:
        raise ClusterError(f"invalid pod CIDR {cidr!r}: {exc}") from None
    probe = str(next(net.hosts()))
    try:
        with socket.socket(socket.AF_INET6 if net.version == 6 else socket.AF_INET) as s:
            s.bind((probe, 0))
    except OSError:
        log.warning(
            "pod CIDR %s is not local to this host (cannot bind %s): pods get these IPs, "
            "but nothing here can serve them (route it to lo: `ip route add local %s dev lo`)",
            cidr,
            probe,
            cidr,
        )


def default_state_dir() -> Path:
    """``$OMNIMODEL_TESTBED_STATE_DIR`` or ``<cache>/cluster``."""
    env = os.environ.get("OMNIMODEL_TESTBED_STATE_DIR")
    return Path(env) if env else cache_root() / "cluster"


@dataclass(frozen=True)
class ClusterState:
    """What ``up`` recorded; enough to use or stop the cluster from anywhere."""

    state_dir: Path
    kubeconfig: Path
    server: str
    ports: Mapping[str, int]
    processes: Sequence[procs.ProcessRecord]
    toolchain: Path
    nodes: Sequence[str]
    started_at: float
    ready_seconds: float
    pod_cidr: str = POD_CIDR
    #: True only on the object returned by the ``up`` call that started the processes.
    started_here: bool = field(default=False, compare=False)

    @property
    def helm(self) -> Path:
        """The helm binary built alongside the cluster."""
        return Toolchain(self.toolchain).path("helm")

    def to_json(self) -> dict[str, Any]:
        """Serialisable form (``started_here`` is per-call, not persisted)."""
        return {
            "version": STATE_VERSION,
            "state_dir": str(self.state_dir),
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "ports": dict(self.ports),
            "processes": [p.to_json() for p in self.processes],
            "toolchain": str(self.toolchain),
            "nodes": list(self.nodes),
            "started_at": self.started_at,
            "ready_seconds": self.ready_seconds,
            "pod_cidr": self.pod_cidr,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClusterState:
        """Inverse of :meth:`to_json`; raises ClusterError on an unknown format."""
        if data.get("version") != STATE_VERSION:
            raise ClusterError(f"unsupported state version {data.get('version')!r}")
        return cls(
            state_dir=Path(data["state_dir"]),
            kubeconfig=Path(data["kubeconfig"]),
            server=str(data["server"]),
            ports={str(k): int(v) for k, v in data["ports"].items()},
            processes=[procs.ProcessRecord.from_json(p) for p in data["processes"]],
            toolchain=Path(data["toolchain"]),
            nodes=[str(n) for n in data["nodes"]],
            started_at=float(data["started_at"]),
            ready_seconds=float(data["ready_seconds"]),
            pod_cidr=str(data.get("pod_cidr", POD_CIDR)),
        )


class Cluster:
    """A local Kubernetes control plane with fake accelerator nodes.

    ``up()`` is idempotent: if the state dir describes a healthy running
    cluster it is reused; leftovers of a dead one are stopped and replaced.
    As a context manager it starts on enter and stops on exit, but only if
    it was this object that started it (so a reused cluster survives).
    """

    def __init__(
        self,
        state_dir: Path | None = None,
        *,
        fleet: Sequence[FakeNode] = DEFAULT_FLEET,
        accelerators: Mapping[Any, AcceleratorSpecLike] | None = None,
        toolchain: Toolchain | None = None,
        timeout: float = 180.0,
        pod_cidr: str | None = None,
    ) -> None:
        self.state_dir = (state_dir or default_state_dir()).resolve()
        self.pod_cidr = pod_cidr or default_pod_cidr()
        self.fleet = tuple(fleet)
        self.accelerators = accelerators
        self.timeout = timeout
        self._toolchain = toolchain
        self._started_here = False

    # ------------------------------------------------------------------ paths
    @property
    def state_file(self) -> Path:
        """Where PIDs/ports are persisted."""
        return self.state_dir / "state.json"

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (client cert in ``system:masters``)."""
        return self.state_dir / "admin.kubeconfig"

    @property
    def pki(self) -> PKI:
        """PKI layout in the state dir."""
        return PKI.at(self.state_dir / "pki")

    # ------------------------------------------------------------------ state
    def load_state(self) -> ClusterState | None:
        """The persisted state, or None if there is none (or it is unreadable)."""
        try:
            data = json.loads(self.state_file.read_text())
            return ClusterState.from_json(data)
        except (FileNotFoundError, json.JSONDecodeError, KeyError, ClusterError):
            return None

    def api(self, state: ClusterState | None = None) -> KubeAPI:
        """Admin REST client for the running cluster."""
        st = state or self.load_state()
        if st is None:
            raise ClusterError(f"no cluster state in {self.state_dir}")
        return KubeAPI(
            "127.0.0.1",
            st.ports["apiserver"],
            self.pki.ca_cert,
            self.pki.admin_cert,
            self.pki.admin_key,
        )

    def healthy(self, state: ClusterState | None = None) -> bool:
        """All recorded processes alive and the apiserver answers /readyz."""
        st = state or self.load_state()
        if st is None or not st.processes:
            return False
        if not all(procs.is_alive(p) for p in st.processes):
            return False
        try:
            return self.api(st).raw("GET", "/readyz")[0] == 200
        except OSError:
            return False

    def status(self) -> dict[str, Any]:
        """Human/machine-readable summary for the ``status`` command."""
        st = self.load_state()
        if st is None:
            return {"state_dir": str(self.state_dir), "up": False, "processes": {}}
        return {
            "state_dir": str(self.state_dir),
            "up": self.healthy(st),
            "kubeconfig": str(st.kubeconfig),
            "server": st.server,
            "ports": dict(st.ports),
            "processes": {p.name: {"pid": p.pid, "alive": procs.is_alive(p), "log": p.log} for p in st.processes},
            "nodes": list(st.nodes),
            "pod_cidr": st.pod_cidr,
            "ready_seconds": st.ready_seconds,
        }

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise up/down across processes (e.g. pytest-xdist workers)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with (self.state_dir / ".lock").open("w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # --------------------------------------------------------------- lifecycle
    def up(self) -> ClusterState:
        """Start the cluster (or reuse a healthy one) and wait until it is usable.

        "Usable" means: apiserver ready, controller-manager and scheduler
        healthy, every fake node Ready without the not-ready taint (so pods
        schedule immediately), and the ``default`` ServiceAccount exists.
        """
        with self._locked():
            existing = self.load_state()
            if existing is not None and self.healthy(existing):
                log.info("cluster already up (%s)", existing.server)
                if existing.pod_cidr != self.pod_cidr:
                    log.warning(
                        "running cluster uses pod CIDR %s, not the requested %s (`down` first to change it)",
                        existing.pod_cidr,
                        self.pod_cidr,
                    )
                return existing
            if existing is not None:
                log.info("stopping leftovers of a previous cluster")
                procs.stop(list(reversed(existing.processes)))
            state = self._start()
            self._started_here = True
            return state

    def down(self) -> list[procs.ProcessRecord]:
        """Stop every recorded process (reverse start order); return those signalled.

        The state dir is kept (logs stay readable); the state file is removed
        so a later ``up`` starts fresh.
        """
        with self._locked():
            st = self.load_state()
            if st is None:
                return []
            stopped = procs.stop(list(reversed(st.processes)))
            self.state_file.unlink(missing_ok=True)
            self._started_here = False
            return stopped

    def __enter__(self) -> ClusterState:
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._started_here:
            self.down()

    # ---------------------------------------------------------------- startup
    def _reset_dir(self) -> None:
        for name in _OWNED:
            p = self.state_dir / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)

    def _start(self) -> ClusterState:
        t0 = time.monotonic()
        started_at = time.time()
        _check_pod_cidr(self.pod_cidr)
        toolchain = self._toolchain or ensure_built()
        self._reset_dir()
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True)
        pki = generate_pki(self.state_dir / "pki", service_ip=SERVICE_IP)
        etcd_client, etcd_peer, api_port, kcm_port, sched_port, kwok_port, registry_port = procs.free_ports(7)
        if self.pod_cidr != POD_CIDR and _port_free(KUBERNETES_SERVICE_PORT):
            # In the test bed's network namespace pods reach the API server as kubernetes.default.svc:443 (the
            # cluster DNS answers the API server's address for it), as kube-proxy routes the kubernetes
            # Service on a node: kopf's in-cluster login names that URL and nothing else.
            api_port = KUBERNETES_SERVICE_PORT
        ports = {
            "etcd": etcd_client,
            "etcd-peer": etcd_peer,
            "apiserver": api_port,
            "controller-manager": kcm_port,
            "scheduler": sched_port,
            "kwok": kwok_port,
            "registry": registry_port,
        }
        server = f"https://127.0.0.1:{api_port}"
        self._write_kubeconfig(server, pki)
        kubeconfig = str(self.kubeconfig)
        started: list[procs.ProcessRecord] = []
        # Keep the processes out of whatever kubeconfig/proxy the caller has.
        env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
        env.pop("KUBECONFIG", None)

        def launch(name: str, args: list[str], extra_env: Mapping[str, str] | None = None) -> None:
            e = dict(env)
            e.update(extra_env or {})
            rec = procs.start(name, [str(toolchain.path(name)), *args], logs / f"{name}.log", env=e)
            started.append(rec)
            # Persist after every start so a crash mid-way leaves PIDs a `down` can find.
            self._write_state(self._partial_state(server, ports, started, toolchain, started_at))

        try:
            launch(
                "etcd",
                [
                    "--name=testbed",
                    f"--data-dir={self.state_dir / 'etcd-data'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-cluster=testbed=http://127.0.0.1:{etcd_peer}",
                    # Throw-away data: fsync only costs time.
                    "--unsafe-no-fsync",
                    "--log-level=warn",
                ],
            )
            procs.wait_until(
                "etcd /health",
                lambda: http_get("127.0.0.1", etcd_client, "/health", tls=False) == 200,
                timeout=30,
                watch=started,
            )
            # The OCI registry pods pull their images from (registry.py): the storage `make images` pushed to.
            storage = registry_storage()
            storage.mkdir(parents=True, exist_ok=True)
            launch(
                "registry",
                ["serve", str(registry_config(storage, registry_port, self.state_dir / "registry.yaml"))],
                REGISTRY_ENV,
            )
            launch("kube-apiserver", self._apiserver_args(pki, etcd_client, api_port))
            api = self.api(self._partial_state(server, ports, started, toolchain, started_at))
            procs.wait_until(
                "kube-apiserver /readyz",
                lambda: api.raw("GET", "/readyz")[0] == 200,
                timeout=90,
                watch=started,
            )
            # Before any pod exists: pods of a pod runner's namespace are labelled for kwok to leave alone.
            install_admission_policy(api)
            common = [
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                "--leader-elect=false",
                "--profiling=false",
            ]
            launch(
                "kube-controller-manager",
                [
                    *common,
                    f"--secure-port={kcm_port}",
                    f"--cert-dir={self.state_dir / 'controller-manager'}",
                    "--controllers=*",
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={pki.sa_key}",
                    f"--root-ca-file={pki.ca_cert}",
                    f"--cluster-signing-cert-file={pki.ca_cert}",
                    f"--cluster-signing-key-file={pki.ca_key}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--allocate-node-cidrs=false",
                ],
            )
            launch(
                "kube-scheduler",
                [
                    *common,
                    f"--secure-port={sched_port}",
                    f"--cert-dir={self.state_dir / 'scheduler'}",
                ],
            )
            kwok_dir = self.state_dir / "kwok"
            kwok_home = kwok_dir / "home"
            kwok_home.mkdir(parents=True)
            kwok_config = self._write_kwok_config(kwok_dir, toolchain)
            launch(
                "kwok",
                [
                    f"--kubeconfig={kubeconfig}",
                    f"--config={kwok_config}",
                    f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
                    f"--cidr={self.pod_cidr}",
                    "--node-ip=127.0.0.1",
                    f"--server-address=127.0.0.1:{kwok_port}",
                    "--node-lease-duration-seconds=40",
                ],
                # kwok also loads ~/.kwok/kwok.yaml if it exists; isolate it.
                {"HOME": str(kwok_home)},
            )
            procs.wait_until(
                "kube-controller-manager /healthz",
                lambda: http_get("127.0.0.1", kcm_port, "/healthz", tls=True) == 200,
                timeout=60,
                watch=started,
            )
            procs.wait_until(
                "kube-scheduler /readyz",
                lambda: http_get("127.0.0.1", sched_port, "/readyz", tls=True) == 200,
                timeout=60,
                watch=started,
            )
            procs.wait_until(
                "kwok /healthz",
                lambda: http_get("127.0.0.1", kwok_port, "/healthz", tls=False) == 200,
                timeout=60,
                watch=started,
            )
            wait_registry(registry_port, started)
            names = self._register_nodes(api, toolchain)
            remaining = max(30.0, self.timeout - (time.monotonic() - t0))
            procs.wait_until(
                f"{len(names)} nodes Ready and untainted",
                lambda: _nodes_ready(api, names),
                timeout=remaining,
                interval=0.2,
                watch=started,
            )
            procs.wait_until(
                "ServiceAccount default/default",
                lambda: api.raw("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
                timeout=60,
                watch=started,
            )
        except BaseException:
            log.error("startup failed; stopping what was started (logs kept in %s)", logs)
            procs.stop(list(reversed(started)))
            self.state_file.unlink(missing_ok=True)
            raise

        state = ClusterState(
            state_dir=self.state_dir,
            kubeconfig=self.kubeconfig,
            server=server,
            ports=ports,
            processes=list(started),
            toolchain=toolchain.root,
            nodes=names,
            started_at=started_at,
            ready_seconds=round(time.monotonic() - t0, 2),
            pod_cidr=self.pod_cidr,
            started_here=True,
        )
        self._write_state(state)
        log.info("cluster up in %.1fs: %s", state.ready_seconds, server)
        return state

    def _partial_state(
        self,
        server: str,
        ports: Mapping[str, int],
        started: Sequence[procs.ProcessRecord],
        toolchain: Toolchain,
        started_at: float,
    ) -> ClusterState:
        return ClusterState(
            self.state_dir,
            self.kubeconfig,
            server,
            ports,
            list(started),
            toolchain.root,
            [],
            started_at,
            -1.0,
            self.pod_cidr,
        )

    def _apiserver_args(self, pki: PKI, etcd_port: int, port: int) -> list[str]:
        return [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            # Without it the apiserver looks for a default route and exits in
            # a sandbox without one.
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.state_dir / 'apiserver'}",
            f"--tls-cert-file={pki.apiserver_cert}",
            f"--tls-private-key-file={pki.apiserver_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            # The `kubernetes` Endpoints cannot hold a loopback address.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            "--profiling=false",
            # Aggregation layer (APIService backends such as metrics-server).
            f"--requestheader-client-ca-file={pki.front_proxy_ca_cert}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki.front_proxy_client_cert}",
            f"--proxy-client-key-file={pki.front_proxy_client_key}",
            # There is no kube-proxy: reach aggregated APIs at their endpoint
            # (loopback pod) IPs rather than the unroutable ClusterIP.
            "--enable-aggregator-routing=true",
        ]

    def _write_kubeconfig(self, server: str, pki: PKI) -> None:
        """Self-contained admin kubeconfig (certs embedded, so it can be copied)."""

        def b64(p: Path) -> str:
            return base64.b64encode(p.read_bytes()).decode()

        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": CONTEXT,
                    "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_cert)},
                }
            ],
            "users": [
                {
                    "name": f"{CONTEXT}-admin",
                    "user": {
                        "client-certificate-data": b64(pki.admin_cert),
                        "client-key-data": b64(pki.admin_key),
                    },
                }
            ],
            "contexts": [
                {
                    "name": CONTEXT,
                    "context": {"cluster": CONTEXT, "user": f"{CONTEXT}-admin", "namespace": "default"},
                }
            ],
            "current-context": CONTEXT,
        }
        self.kubeconfig.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    def _write_kwok_config(self, kwok_dir: Path, toolchain: Toolchain) -> Path:
        """One multi-document file: KwokConfiguration followed by the Stage docs.

        The standalone kwok controller has no built-in stages; without these
        it exits with "no stages found". kwok (v0.8.0) applies its option
        defaults only when *no* KwokConfiguration is given, so every defaulted
        option is spelled out here (values from its zz_generated.defaults.go);
        otherwise e.g. nodeLeaseParallelism=0 makes it exit at start.
        """
        kwok_cfg = {
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "kind": "KwokConfiguration",
            "metadata": {"name": "omnimodel-testbed"},
            "options": {
                "cidr": self.pod_cidr,
                "nodeIP": "127.0.0.1",
                "manageAllNodes": False,
                "manageNodesWithAnnotationSelector": f"{KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
                "nodeLeaseDurationSeconds": 40,
                "enableDebuggingHandlers": True,
                "enableContentionProfiling": False,
                "enableProfilingHandler": False,
                "podPlayStageParallelism": 4,
                "nodePlayStageParallelism": 4,
                "nodeLeaseParallelism": 4,
                "podsOnNodeSyncParallelism": 1,
                "enablePodsOnNodeSyncListPager": True,
                "enablePodsOnNodeSyncStreamWatch": False,
            },
        }
        # kwok's own stages, with the pods a pod runner plays left out of them (runnerpods.py).
        stages = kwok_stages([yaml.safe_load(p.read_text()) for p in toolchain.stage_files()])
        path = kwok_dir / "kwok.yaml"
        path.write_text(yaml.dump_all([kwok_cfg, *stages], Dumper=_BlockDumper, sort_keys=False))
        return path

    def _register_nodes(self, api: KubeAPI, toolchain: Toolchain) -> list[str]:
        names: list[str] = []
        kubelet_version = toolchain.versions().get("kubernetes")
        for obj in build_nodes(self.fleet, self.accelerators, kubelet_version=kubelet_version):
            name = str(obj["metadata"]["name"])
            try:
                api.create("/api/v1/nodes", obj)
            except ApiError as exc:
                if exc.status != 409:
                    raise
            names.append(name)
        return names

    def _write_state(self, state: ClusterState) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state.to_json(), indent=2))
        tmp.replace(self.state_file)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (kwok's status templates) as literal blocks, so kwok.yaml stays readable."""


def _str_block(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_BlockDumper.add_representer(str, _str_block)


def _nodes_ready(api: KubeAPI, names: Sequence[str]) -> bool:
    """Every node Ready=True and free of the not-ready/unreachable taints."""
    items = api.get("/api/v1/nodes")["items"]
    by_name = {i["metadata"]["name"]: i for i in items}
    for n in names:
        node = by_name.get(n)
        if node is None:
            return False
        conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        if conds.get("Ready") != "True":
            return False
        taint_keys = {t["key"] for t in node.get("spec", {}).get("taints", []) or []}
        if taint_keys & {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}:
            return False
    return True
