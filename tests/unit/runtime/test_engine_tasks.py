"""The (engine, task) pairs the CRD and the operator accept are exactly those the runtime can run."""

from __future__ import annotations

from omnimodel_runtime.engines.registry import supported
from omnimodel_runtime.pipeline import ENGINE_TASKS


def test_the_pipeline_contract_lists_exactly_the_registered_adapters() -> None:
    declared = {(engine.value, task) for engine, tasks in ENGINE_TASKS.items() for task in tasks}
    assert declared == set(supported())
