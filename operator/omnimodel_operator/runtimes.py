"""The runtimes an OmniModel can run on (``spec.runtime.kind``), behind one protocol.

:func:`resolve` reads the spec's runtime kind once and returns a :class:`Runtime` bound to its plan; from
then on reconcile, the autoscaler and ``omnimodel-operator render`` call its methods and never ask which
runtime it is. Each runtime's own pieces stay where they were (builders, status, ``vllm_omni/``): this
module sits above all of them and only puts them behind the protocol. A new runtime is one class here
and one entry in :data:`RUNTIMES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import httpx

from omnimodel_operator import naming
from omnimodel_operator.api.v1alpha1 import Autoscaling, OmniModelSpec
from omnimodel_operator.builders import Manifest, render_omnimodel, with_applied_hash
from omnimodel_operator.builders.vllm_omni import (
    head_deployment_name,
    render_vllm_omni,
    replica_deployment_name,
    restart_marks_of,
)
from omnimodel_operator.kube import KubeClient
from omnimodel_operator.observed import Key, Observed
from omnimodel_operator.resolve import Plan, resolve_omnimodel
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import parse_spec
from omnimodel_operator.status import ComponentState, component_state
from omnimodel_operator.vllm_omni.membership import publish
from omnimodel_operator.vllm_omni.plan import VllmPlan, resolve_vllm_omni
from omnimodel_operator.vllm_omni.restarts import is_head_pod, is_replica_pod
from omnimodel_operator.vllm_omni.state import vllm_components
from omnimodel_runtime.pipeline import StageKind


@dataclass(frozen=True)
class Scaled:
    """One stage the operator's autoscaler scales: its Deployment and how its signal is read."""

    stage: str
    deployment: str
    spec: Autoscaling
    metric: str
    target: float


@dataclass(frozen=True)
class Scrape:
    """Which ``/metrics`` the autoscaler reads beyond the gateway's (or head's)."""

    # Stage pods scraped themselves (their queue depth is theirs alone).
    stages: tuple[str, ...] = ()
    # vLLM-Omni's head labels its metrics by stage id: id → stage name.
    stage_ids: Mapping[str, str] | None = None


class Runtime(Protocol):
    """What differs between the runtimes an OmniModel runs on, for one resolved spec."""

    @property
    def plan(self) -> Plan | VllmPlan:
        """What both plans share (name, namespace, spec, stages, uid, the status view) is read off it."""
        ...

    def children(self, settings: OperatorSettings, observed: Observed | None) -> list[Manifest]:
        """Every child, in apply order, not yet stamped (see :func:`render`)."""
        ...

    def components(
        self, current: Mapping[Key, Manifest], pods: Sequence[Manifest]
    ) -> tuple[list[ComponentState], ComponentState]:
        """Rollout state per stage, and of what serves the API (the gateway, or vLLM-Omni's head)."""
        ...

    def autoscaled(self) -> list[Scaled]:
        """Stages on ``provider: operator``, with the metric and target each uses (defaults per runtime)."""
        ...

    def scrape(self, scaled: Sequence[Scaled]) -> Scrape: ...

    async def observe(self, client: KubeClient, http: httpx.AsyncClient, observed: Observed) -> None:
        """Each autoscaler round, before scaling: record what only the live pods can tell."""
        ...


def _matches(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _autoscaling(spec: Any) -> Autoscaling | None:
    auto: Autoscaling | None = spec.autoscaling if spec is not None else None
    return auto if auto is not None and auto.provider == "operator" else None


@dataclass(frozen=True)
class OmniModelRuntime:
    """This project's runtime: a gateway and one Deployment per stage."""

    plan: Plan

    def children(self, settings: OperatorSettings, observed: Observed | None) -> list[Manifest]:
        return render_omnimodel(self.plan, settings, observed.stage_bytes if observed else None)

    def components(
        self, current: Mapping[Key, Manifest], pods: Sequence[Manifest]
    ) -> tuple[list[ComponentState], ComponentState]:
        plan = self.plan
        stages = []
        for sp in plan.stages:
            name = naming.stage_name(plan.name, sp.stage.name)
            mine = [p for p in pods if _matches(p, naming.stage_selector(plan.name, sp.stage.name))]
            stages.append(component_state(sp.stage.name, current.get(("Deployment", name)), mine))
        gateway_pods = [p for p in pods if _matches(p, naming.gateway_selector(plan.name))]
        gateway = component_state("gateway", current.get(("Deployment", naming.gateway_name(plan.name))), gateway_pods)
        return stages, gateway

    def autoscaled(self) -> list[Scaled]:
        out = []
        for sp in self.plan.stages:
            if (auto := _autoscaling(sp.spec)) is None:
                continue
            metric = auto.metric or ("pendingSeconds" if sp.stage.kind is StageKind.DIFFUSION else "inFlight")
            deployment = naming.stage_name(self.plan.name, sp.name)
            out.append(Scaled(sp.name, deployment, auto, metric, auto.target_for(metric)))
        return out

    def scrape(self, scaled: Sequence[Scaled]) -> Scrape:
        return Scrape(stages=tuple(s.stage for s in scaled if s.metric == "queueDepth"))

    async def observe(self, client: KubeClient, http: httpx.AsyncClient, observed: Observed) -> None:
        return None  # the gateway's metrics say all the autoscaler needs


@dataclass(frozen=True)
class VllmOmniRuntime:
    """vLLM-Omni: a head pod serving the API, replicas that register with it (``vllm_omni/``)."""

    plan: VllmPlan

    def children(self, settings: OperatorSettings, observed: Observed | None) -> list[Manifest]:
        # The head and its replicas restart together, so what is live decides this pass's marks.
        marks = restart_marks_of(self.plan, observed)
        return render_vllm_omni(self.plan, settings, marks, observed.stage_bytes if observed else None)

    def components(
        self, current: Mapping[Key, Manifest], pods: Sequence[Manifest]
    ) -> tuple[list[ComponentState], ComponentState]:
        return vllm_components(self.plan, current, pods)

    def autoscaled(self) -> list[Scaled]:
        out = []
        for sp in self.plan.stages:
            if (auto := _autoscaling(sp.spec)) is None:
                continue
            metric = auto.metric or "queueDepth"
            out.append(Scaled(sp.name, replica_deployment_name(self.plan, sp), auto, metric, auto.target_for(metric)))
        return out

    def scrape(self, scaled: Sequence[Scaled]) -> Scrape:
        return Scrape(stage_ids={str(s.stage.id): s.name for s in self.plan.stages})

    async def observe(self, client: KubeClient, http: httpx.AsyncClient, observed: Observed) -> None:
        # Which replica pods the head routes to (vllm_omni/membership.py), recorded before scaling reads
        # it: a scale-down must never count a replica the head has already dropped.
        await publish(
            client, http, self.plan, observed.objects.get(("Deployment", head_deployment_name(self.plan))),
            [p for p in observed.pods if is_head_pod(p)], [p for p in observed.pods if is_replica_pod(p)],
        )  # fmt: skip


def _omnimodel(name: str, namespace: str, spec: OmniModelSpec, settings: OperatorSettings, uid: str | None) -> Runtime:
    return OmniModelRuntime(resolve_omnimodel(name, namespace, spec, settings, uid=uid))


def _vllm_omni(name: str, namespace: str, spec: OmniModelSpec, settings: OperatorSettings, uid: str | None) -> Runtime:
    return VllmOmniRuntime(resolve_vllm_omni(name, namespace, spec, settings, uid=uid))


# spec.runtime.kind → its planner, bound to the runtime that deploys and observes the plan.
RUNTIMES: Final[Mapping[str, Callable[[str, str, OmniModelSpec, OperatorSettings, str | None], Runtime]]] = {
    "omnimodel": _omnimodel,
    "vllm-omni": _vllm_omni,
}


def resolve(
    name: str,
    namespace: str,
    raw_spec: Mapping[str, Any] | OmniModelSpec,
    settings: OperatorSettings,
    uid: str | None = None,
) -> Runtime:
    """Spec → the runtime it names, holding its plan; or :class:`~omnimodel_operator.spec.InvalidSpec`."""
    spec = raw_spec if isinstance(raw_spec, OmniModelSpec) else parse_spec(raw_spec)
    return RUNTIMES[spec.runtime.kind](name, namespace, spec, settings, uid)


def render(runtime: Runtime, settings: OperatorSettings, observed: Observed | None = None) -> list[Manifest]:
    """Every child of one OmniModel, in apply order (config before the pods that mount it), each stamped
    with its applied hash (:func:`~omnimodel_operator.builders.with_applied_hash`).

    ``observed`` (the live children and pods) matters only where a runtime restarts pods together
    (vLLM-Omni's head and replicas, :mod:`omnimodel_operator.vllm_omni.restarts`).
    """
    return [with_applied_hash(m) for m in runtime.children(settings, observed)]
