"""Replicas follow a new head process (vLLM-Omni 0.30.0: a restarted head is never rejoined by the old
replicas), a lost replica restarts nothing, decided from live pods, with nothing restarted at creation
and no restart loop."""

from __future__ import annotations

from typing import Any

from omnimodel_operator.vllm_omni.restarts import EPOCH, PENDING, REGISTERED_WITH, REPLICA_PODS, restart_marks


def pod(
    uid: str, *, restarts: int = 0, running: bool = True, epoch: int | None = None, created: str = "t0"
) -> dict[str, Any]:
    state = {"running": {}} if running else {"waiting": {"reason": "ContainerCreating"}}
    meta: dict[str, Any] = {"uid": uid, "creationTimestamp": created}
    if epoch is not None:
        meta["annotations"] = {EPOCH: str(epoch)}
    return {"metadata": meta, "status": {"containerStatuses": [{"restartCount": restarts, "state": state}]}}


def deployment(metadata: dict[str, str], template: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"annotations": metadata}, "spec": {"template": {"metadata": {"annotations": template}}}}


def live(marks: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Deployments as the API server would hold them after the operator applied these marks."""
    return (
        deployment(marks.head_metadata, marks.head_template),
        deployment(marks.replica_metadata, marks.replica_template),
    )


def test_creation_adopts_the_first_head_without_restarting_anything() -> None:
    first = restart_marks(None, [None], [], [])
    assert (first.replica_metadata[REGISTERED_WITH], first.replica_template[EPOCH]) == (PENDING, "0")
    head, replica = live(first)
    running = restart_marks(head, [replica], [pod("h1")], [pod("r1", epoch=0)])
    assert running.replica_metadata[REGISTERED_WITH] == "h1:0"
    assert (running.head_template[EPOCH], running.replica_template[EPOCH]) == ("0", "0")
    assert running.head_metadata[REPLICA_PODS] == "0/r1:0"


def test_a_restarted_head_restarts_the_replicas_once() -> None:
    head, replica = live(restart_marks(None, [None], [pod("h1")], []))
    head, replica = live(restart_marks(head, [replica], [pod("h1")], [pod("r1", epoch=0)]))
    after = restart_marks(head, [replica], [pod("h1", restarts=1)], [pod("r1", epoch=0)])  # liveness restart
    assert after.replica_template[EPOCH] == "1"
    assert after.head_template[EPOCH] == "0"  # the old replica is of the old epoch: not a loss
    head, replica = live(after)
    again = restart_marks(head, [replica], [pod("h1", restarts=1)], [pod("r2", epoch=1)])
    assert (again.replica_template[EPOCH], again.head_template[EPOCH]) == ("1", "0")
    assert again.head_metadata[REPLICA_PODS] == "1/r2:0"


def test_a_lost_replica_leaves_the_head_alone_and_a_new_head_restarts_the_replicas_once() -> None:
    head, replica = live(restart_marks(None, [None], [pod("h1")], []))
    head, replica = live(restart_marks(head, [replica], [pod("h1")], [pod("r1", epoch=0), pod("r2", epoch=0)]))
    # r1 went away (scaled down, killed): the head keeps serving with r2; nothing restarts.
    lost = restart_marks(head, [replica], [pod("h1")], [pod("r2", epoch=0)])
    assert (lost.head_template[EPOCH], lost.replica_template[EPOCH]) == ("0", "0")
    assert lost.head_metadata[REPLICA_PODS] == "0/r2:0"
    head, replica = live(lost)
    # A new head process (its pod deleted: Recreate makes a new one): the replicas restart to register with it.
    new_head = restart_marks(head, [replica], [pod("h2", created="t1")], [pod("r2", epoch=0)])
    assert (new_head.head_template[EPOCH], new_head.replica_template[EPOCH]) == ("0", "1")
    head, replica = live(new_head)
    settled = restart_marks(head, [replica], [pod("h2", created="t1")], [pod("r4", epoch=1), pod("r5", epoch=1)])
    assert (settled.head_template[EPOCH], settled.replica_template[EPOCH]) == ("0", "1")
    head, replica = live(settled)
    still = restart_marks(head, [replica], [pod("h2", created="t1")], [pod("r4", epoch=1), pod("r5", epoch=1)])
    assert still == settled


def test_a_replica_that_never_ran_is_not_a_loss() -> None:
    head, replica = live(restart_marks(None, [None], [pod("h1")], []))
    pending = restart_marks(head, [replica], [pod("h1")], [pod("r1", epoch=0, running=False)])
    head, replica = live(pending)
    gone = restart_marks(head, [replica], [pod("h1")], [])
    assert gone.head_template[EPOCH] == "0"
