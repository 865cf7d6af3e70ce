"""Model weights on a cluster: fetch an ``hf://`` model's files once into a shared cache, only those its
stages need, and give each stage a directory of its own files (:mod:`.cache` describes the layout).

``omnimodel fetch`` (:func:`fetch_pipeline`), ``omnimodel wait-weights`` (:func:`wait_for_weights`) and a
stage's start (:func:`stage_model_dir`, through :mod:`omnimodel_runtime.models`) are its three uses.
"""

from omnimodel_runtime.fetch.cache import Marker, default_cache_dir, marker_path, read_marker, snapshot_dir
from omnimodel_runtime.fetch.hub import REASONS, WeightsError
from omnimodel_runtime.fetch.plan import WeightsPlan, hf_repo
from omnimodel_runtime.fetch.progress import FetchProgress, ProgressServer, Ticker
from omnimodel_runtime.fetch.run import (
    FetchResult,
    fetch_pipeline,
    stage_model_dir,
    wait_for_weights,
    weights_status,
)

__all__ = [
    "REASONS",
    "FetchProgress",
    "FetchResult",
    "Marker",
    "ProgressServer",
    "Ticker",
    "WeightsError",
    "WeightsPlan",
    "default_cache_dir",
    "fetch_pipeline",
    "hf_repo",
    "marker_path",
    "read_marker",
    "snapshot_dir",
    "stage_model_dir",
    "wait_for_weights",
    "weights_status",
]
