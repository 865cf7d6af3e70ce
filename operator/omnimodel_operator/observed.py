"""What the watch-fed cache holds for one OmniModel, as reconcile, the autoscaler and the weights
progress read it. Its own module, below all of them, so the cache that builds it and the builders that
read it depend on neither reconcile nor each other."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from omnimodel_operator.kube import Manifest

Key = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class Observed:
    """What the watch-fed cache holds for one OmniModel: objects carrying its instance label, by
    (kind, name), and its pods. Ownership is checked here, not by whoever built the snapshot."""

    objects: Mapping[Key, Manifest] = field(default_factory=dict)
    pods: Sequence[Manifest] = ()
    # Bytes of each stage's weights as this OmniModel's fetch reported them (status.weights.stageBytes),
    # once known: what a stage holding its weights in host memory requests (builders/common.py).
    stage_bytes: Mapping[str, int] = field(default_factory=dict)
