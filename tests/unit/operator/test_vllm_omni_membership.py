"""Status counts a vLLM-Omni replica pod only when the head has it registered; one the head detached while
it runs is lost capacity naming its stage (vllm_omni/membership.py, vllm_omni/state.py)."""

from __future__ import annotations

from typing import Any

from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import parse_spec
from omnimodel_operator.status import ComponentState
from omnimodel_operator.vllm_omni.membership import Membership, StageMembers, membership_of
from omnimodel_operator.vllm_omni.plan import resolve_vllm_omni
from omnimodel_operator.vllm_omni.state import registered_only

SPEC = {
    "model": {"source": "file:///models/qwen-image"},
    "runtime": {"kind": "vllm-omni"},
    "stages": [{"name": "dit", "replicas": 3, "accelerator": {"vendor": "cpu"}}],
}


def replica(name: str, ip: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": "stage", "omnimodel.io/stage": "dit"}},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def answer(*hosts: str, up: bool = True) -> dict[str, Any]:
    rows = [{"replica": 0, "host": None, "up": True}] + [
        {"replica": i + 1, "host": h, "up": up} for i, h in enumerate(hosts)
    ]
    return {"stages": {"0": rows}}


def test_a_detached_replica_is_lost_and_degrades_its_stage() -> None:
    plan = resolve_vllm_omni("qimg", "ml", parse_spec(SPEC), OperatorSettings())
    pods = [replica("a", "10.0.0.1"), replica("b", "10.0.0.2")]
    both = membership_of(plan, answer("10.0.0.1", "10.0.0.2"), pods, None)  # type: ignore[arg-type]
    assert both.stages["dit"] == StageMembers(("10.0.0.1", "10.0.0.2"), ())
    one = membership_of(plan, answer("10.0.0.2"), pods, both)  # type: ignore[arg-type]
    assert one.stages["dit"] == StageMembers(("10.0.0.2",), ("10.0.0.1",))
    assert Membership.from_annotation(one.to_annotation()) == one

    rolled_out = ComponentState("dit", desired=2, ready=2, updated=2, available=2, reason=None)
    assert registered_only(rolled_out, pods, both.stages["dit"]) == rolled_out
    state = registered_only(rolled_out, pods, one.stages["dit"])
    assert (state.ready, state.available, state.degraded, state.reason) == (1, 1, True, "PodsNotReady")
    assert state.message == "dit: 1 replica(s) detached by the vLLM-Omni head: a"
    # Where the kubelet runs probes, the detached pod's readiness has taken it out already: still lost.
    unready = {**pods[0], "status": {**pods[0]["status"], "conditions": [{"type": "Ready", "status": "False"}]}}
    probed = ComponentState("dit", desired=2, ready=1, updated=2, available=1, reason="PodsNotReady")
    state = registered_only(probed, [unready, pods[1]], one.stages["dit"])
    assert (state.ready, state.available, state.degraded) == (1, 1, True)
    assert state.message == "dit: 1 replica(s) detached by the vLLM-Omni head: a"


def test_a_replica_not_registered_yet_is_starting_not_lost() -> None:
    plan = resolve_vllm_omni("qimg", "ml", parse_spec(SPEC), OperatorSettings())
    pods = [replica("a", "10.0.0.1"), replica("new", "10.0.0.3")]
    members = membership_of(plan, answer("10.0.0.1"), pods, None)  # type: ignore[arg-type]
    state = registered_only(ComponentState("dit", 2, 2, 2, 2, reason=None), pods, members.stages["dit"])
    assert (state.ready, state.degraded, state.reason) == (1, False, "Updating")
    # A pod that left is not lost either: it is not running.
    gone = membership_of(plan, answer("10.0.0.1"), pods[:1], members)  # type: ignore[arg-type]
    assert gone.stages["dit"].lost == ()
