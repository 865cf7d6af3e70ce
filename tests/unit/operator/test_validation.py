"""The operator's own checks of specs the API server would also refuse (CEL): an engine that does not run its
preset stage's task, tiny:// models that do not exist or belong to another preset, vLLM-Omni engine
arguments that are not numbers. The operator parses specs that never met an API server (``render``, a CRD
installed without its rules), so each of these must be an InvalidSpec naming the field, not a rollout that
fails in the pod."""

from __future__ import annotations

from typing import Any

import pytest

from omnimodel_operator.api.v1alpha1 import TINY_MODELS
from omnimodel_operator.api.v1alpha1.rules import OPERATOR_ENGINE_ARGS, preset_engines, tiny_models_of
from omnimodel_operator.runtimes import resolve
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import InvalidSpec
from omnimodel_operator.vllm_omni import plan as vllm_plan
from omnimodel_runtime.pipeline import ENGINE_TASKS, PRESETS
from omnimodel_runtime.tiny import TINY_BUILDERS

SETTINGS = OperatorSettings()


def preset_spec(preset: str, source: str, stages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"model": {"source": source}, "preset": preset, **({"stages": stages} if stages else {})}


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (preset_spec("text", "tiny://text", [{"name": "llm", "engine": "diffusers"}]),
         "spec.stages[llm].engine", "engine diffusers does not run task text-generation"),
        (preset_spec("tts", "tiny://tts", [{"name": "vocoder", "engine": "vllm"}]),
         "spec.stages[vocoder].engine", "engines that do: transformers"),
        (preset_spec("text", "tiny://text-to-image"), "spec.model.source",
         "tiny://text-to-image is built for preset text-to-image; preset text needs tiny://text"),
        (preset_spec("text", "tiny://nosuchpreset"), "spec.model.source", "no tiny model 'nosuchpreset'"),
        ({"model": {"source": "tiny://nosuchpreset"},
          "stages": [{"name": "a", "kind": "ar", "engine": "vllm", "task": "text-generation", "outputs": ["text"]}]},
         "spec.model.source", "no tiny model 'nosuchpreset'"),
        ({"model": {"source": "hf://o/m"}, "runtime": {"kind": "vllm-omni", "deployConfig": "qwen2_5_omni"},
          "stages": [{"name": "talker", "engineArgs": {"tensor_parallel_size": "two"}}]},
         "spec.stages[talker].engineArgs.tensor_parallel_size", "must be a whole number, not 'two'"),
    ],
)  # fmt: skip
def test_specs_that_would_fail_in_the_pod_are_refused_naming_the_field(
    spec: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidSpec) as info:
        resolve("m", "ml", spec, SETTINGS, uid="u")
    assert info.value.field == field, info.value
    assert words in info.value.message, info.value


@pytest.mark.parametrize(
    "spec",
    [
        preset_spec("text", "tiny://text", [{"name": "llm", "engine": "transformers"}]),
        preset_spec("qwen2.5-omni", "tiny://qwen2.5-omni-vllm-omni"),
        preset_spec("text-to-image", "tiny://text-to-image"),
        preset_spec("text", "hf://org/model"),
    ],
    ids=["engine-that-runs-the-task", "tiny-variant", "own-tiny-model", "not-tiny"],
)
def test_their_neighbours_still_resolve(spec: dict[str, Any]) -> None:
    assert resolve("m", "ml", spec, SETTINGS, uid="u").plan.name == "m"


def test_the_tiny_models_named_in_the_crd_are_the_runtimes() -> None:
    """The operator may not import the runtime's tiny builders, so it keeps their names: the two must agree,
    and every variant must belong to a preset whose name it starts with."""
    assert set(TINY_MODELS) == set(TINY_BUILDERS)
    for name, preset in TINY_MODELS.items():
        assert preset in PRESETS and (name == preset or name.startswith(f"{preset}-")), name
    assert tiny_models_of("text") == ("text",)


def test_the_engine_table_in_the_crd_is_what_the_operator_checks() -> None:
    for name, preset in PRESETS.items():
        for stage in preset.stages:
            allowed = preset_engines()[name][stage.name]
            assert stage.engine.value in allowed
            assert set(allowed) == {e.value for e, tasks in ENGINE_TASKS.items() if stage.task in tasks}


def test_the_engine_args_the_crd_refuses_for_vllm_omni_are_the_ones_the_operator_sets() -> None:
    assert set(OPERATOR_ENGINE_ARGS) == set(vllm_plan._OPERATOR_FIELDS)
