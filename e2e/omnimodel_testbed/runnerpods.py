"""Which pods a :class:`~omnimodel_testbed.kubelet.PodRunner` runs, and how kwok is told to leave them to it.

kwok plays a pod's whole lifecycle from its Stage documents: Running and Ready at once, and (the
``pod-complete`` stage) Succeeded at once for every pod a Job owns. A pod whose command really runs
needs one owner of its status: its init containers finish before it is Ready, its phase follows its
process's exit, and its termination message is the one the process wrote. So in a namespace a pod
runner serves, kwok only does what the network plugin and the scheduler side would (a pod IP), and the
runner does what the kubelet does (everything else).

The mark has to be on the pod from the moment it exists, or kwok completes a Job's pod before a polling
runner sees it. Pods are created by controllers (a Job's, a Deployment's) from templates the test does not
write, so the mark is added at admission: a MutatingAdmissionPolicy, installed when the cluster starts,
labels every pod created in a namespace labelled :data:`RUNNER_LABEL`; the runner labels its namespace
when it starts (and waits until a dry-run pod comes back labelled, so the apiserver's policy and
namespace caches have caught up). kwok's Pod stages skip pods with the label, and one more stage gives them
their IP and leaves them Pending. A deleted runner pod is the runner's to remove, as a kubelet removes a
pod once its containers have stopped (preStop hook, SIGTERM, grace period): until then it keeps its object
(Terminating) and so its IP, which kwok would hand to the next pod. A last stage removes it at the end of
its grace period in case no runner does (the runner stopped). Everything else in the cluster (pods of
namespaces no runner serves, Jobs of plain kwok suites) keeps kwok's behaviour.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from typing import Any, Final

from .kubeapi import ApiError, KubeAPI

__all__ = [
    "RUNNER_LABEL",
    "RUNNER_POLICY",
    "admission_policy",
    "install_admission_policy",
    "kwok_stages",
    "serve_namespace",
]

log = logging.getLogger("omnimodel_testbed")

#: On a namespace: a pod runner serves it. On a pod (set at admission): the runner, not kwok, plays it.
RUNNER_LABEL: Final = "testbed.omnimodel.io/pod-runner"
#: Name of the MutatingAdmissionPolicy (and its binding) that labels the pods.
RUNNER_POLICY: Final = "omnimodel-testbed-pod-runner"

_POLICY_PATH: Final = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies"
_BINDING_PATH: Final = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings"
_LABEL_QUERY: Final = f'.metadata.labels["{RUNNER_LABEL}"]'
#: The one stage runner pods get: an IP (as a CNI gives the sandbox), phase Pending; the runner takes over.
_RUNNER_STAGE: Final = "pod-runner-create"
#: Runner pods deleted and not removed by a runner by the end of their grace period: removed then.
_RUNNER_DELETE_STAGE: Final = "pod-runner-delete"
_RUNNER_STAGE_TEMPLATE: Final = """\
{{ $hostIPs := NodeIPsWith .spec.nodeName }}
{{ with $hostIPs }}
hostIP: {{ index . 0 | Quote }}
hostIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
{{ with $podIPs }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
phase: Pending
"""  # noqa: E501  (kwok's own template line, kept whole)


def admission_policy() -> list[dict[str, Any]]:
    """The MutatingAdmissionPolicy and binding that label pods created in a runner's namespace."""
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingAdmissionPolicy",
            "metadata": {"name": RUNNER_POLICY},
            "spec": {
                "matchConstraints": {
                    "resourceRules": [
                        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
                    ]
                },
                # A pod that slipped through unlabelled would be completed by kwok behind the runner's back.
                "failurePolicy": "Fail",
                "reinvocationPolicy": "Never",
                "mutations": [
                    {
                        "patchType": "ApplyConfiguration",
                        "applyConfiguration": {
                            "expression": f'Object{{metadata: Object.metadata{{labels: {{"{RUNNER_LABEL}": "true"}}}}}}'
                        },
                    }
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingAdmissionPolicyBinding",
            "metadata": {"name": RUNNER_POLICY},
            "spec": {
                "policyName": RUNNER_POLICY,
                "matchResources": {"namespaceSelector": {"matchLabels": {RUNNER_LABEL: "true"}}},
            },
        },
    ]


def install_admission_policy(api: KubeAPI) -> None:
    """Create the policy and its binding (idempotent); the cluster does this when it starts."""
    for obj, path in zip(admission_policy(), (_POLICY_PATH, _BINDING_PATH), strict=True):
        try:
            api.create(path, obj)
        except ApiError as exc:
            if exc.status != 409:
                raise


def kwok_stages(stages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """kwok's Stage documents with runner pods left out of every Pod stage, plus the stage that gives
    runner pods their IP and the one that removes a deleted one the runner left."""
    out: list[dict[str, Any]] = []
    for doc in stages:
        stage = copy.deepcopy(doc)
        spec = stage.get("spec") or {}
        if (spec.get("resourceRef") or {}).get("kind") == "Pod":
            expressions = spec.setdefault("selector", {}).setdefault("matchExpressions", [])
            expressions.append({"key": _LABEL_QUERY, "operator": "DoesNotExist"})
        out.append(stage)
    out.append(
        {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "Stage",
            "metadata": {"name": _RUNNER_STAGE},
            "spec": {
                "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
                "selector": {
                    "matchExpressions": [
                        {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                        {"key": _LABEL_QUERY, "operator": "Exists"},
                        {"key": ".status.podIP", "operator": "DoesNotExist"},
                    ]
                },
                "next": {"statusTemplate": _RUNNER_STAGE_TEMPLATE},
            },
        }
    )
    out.append(
        {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "Stage",
            "metadata": {"name": _RUNNER_DELETE_STAGE},
            "spec": {
                "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
                "selector": {
                    "matchExpressions": [
                        {"key": ".metadata.deletionTimestamp", "operator": "Exists"},
                        {"key": _LABEL_QUERY, "operator": "Exists"},
                    ]
                },
                # The deletion timestamp is when the grace period ends: kwok waits until then.
                "delay": {"durationFrom": {"expressionFrom": ".metadata.deletionTimestamp"}},
                "next": {"delete": True},
            },
        }
    )
    return out


def serve_namespace(api: KubeAPI, namespace: str, timeout: float = 30.0) -> None:
    """Mark ``namespace`` as served by a pod runner; return once new pods there are labelled at admission."""
    try:
        api.get(f"{_POLICY_PATH}/{RUNNER_POLICY}")
    except ApiError as exc:
        if exc.status != 404:
            raise
        raise RuntimeError(
            f"MutatingAdmissionPolicy {RUNNER_POLICY} is missing: this cluster was started by an older test bed, "
            "whose kwok would complete Job pods behind the pod runner (python -m omnimodel_testbed down, then up)"
        ) from None
    api.patch(f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {RUNNER_LABEL: "true"}}})
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "pod-runner-probe"},
        "spec": {"containers": [{"name": "probe", "image": "probe"}], "automountServiceAccountToken": False},
    }
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            created = api.create(f"/api/v1/namespaces/{namespace}/pods?dryRun=All", probe)
        except ApiError as exc:
            # Until the controller-manager has made the namespace's default ServiceAccount, admission refuses.
            last = str(exc)
        else:
            if RUNNER_LABEL in (created["metadata"].get("labels") or {}):
                log.info("pod runner serves namespace %s: kwok leaves its new pods to the runner", namespace)
                return
            last = "the dry-run pod came back unlabelled"
        time.sleep(0.2)
    raise RuntimeError(f"pods in {namespace} are not labelled {RUNNER_LABEL} after {timeout:.0f}s: {last}")
