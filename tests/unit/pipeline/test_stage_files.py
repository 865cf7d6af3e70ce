"""Per-stage file sets: the pattern language, tensor prefixes, and what each preset's stages read."""

from __future__ import annotations

import pytest

from omnimodel_runtime.pipeline import (
    PRESETS,
    ModelSource,
    StageFiles,
    StageFilesError,
    get_preset,
    needs_weight_map,
    parse_pipeline,
    select_files,
)

# The tiny text-to-image layout (``omnimodel make-tiny --preset text-to-image``), sizes as built.
T2I_LAYOUT = {
    ".gitattributes": 434,
    "README.md": 146,
    "model_index.json": 441,
    "scheduler/scheduler_config.json": 480,
    "text_encoder/config.json": 1665,
    "text_encoder/generation_config.json": 216,
    "text_encoder/model.safetensors": 263328,
    "tokenizer/tokenizer.json": 55134,
    "tokenizer/tokenizer_config.json": 251,
    "transformer/config.json": 412,
    "transformer/diffusion_pytorch_model.safetensors": 770752,
    "vae/config.json": 409,
    "vae/diffusion_pytorch_model.safetensors": 16230492,
}


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("*.json", "config.json", True),
        ("*.json", "vae/config.json", False),  # unlike fnmatch, * stays inside one folder
        ("vae/**", "vae/config.json", True),
        ("vae/**", "vae/sub/x.bin", True),
        ("vae/**", "vae", False),
        ("vae/", "vae/config.json", True),
        ("**/config.json", "config.json", True),
        ("**/config.json", "a/b/config.json", True),
        ("**", "a/b/c", True),
        ("text_encoder*/**", "text_encoder_2/model.safetensors", True),
        ("model-0000?-of-00005.safetensors", "model-00003-of-00005.safetensors", True),
        ("[!.]*", ".gitattributes", False),
        ("[!.]*", "README.md", True),
        ("a.b", "aXb", False),  # dots are literal
    ],
)
def test_pattern_language(pattern: str, path: str, matches: bool) -> None:
    assert StageFiles(patterns=(pattern,)).matches(path) is matches


@pytest.mark.parametrize("pattern", ["/abs", "../up", "a/../b", "a\\b", "[unclosed"])
def test_bad_patterns_are_rejected(pattern: str) -> None:
    with pytest.raises(ValueError, match="pattern"):
        StageFiles(patterns=(pattern,))


def test_a_file_set_needs_something() -> None:
    with pytest.raises(ValueError, match="at least one"):
        StageFiles()


def test_no_file_set_means_every_file() -> None:
    assert select_files(None, T2I_LAYOUT) == tuple(sorted(T2I_LAYOUT))


def test_tensor_prefixes_pick_the_shards_the_index_maps_them_to() -> None:
    listing = [
        "config.json",
        "model.safetensors.index.json",
        *(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
    ]
    weight_map = {
        "thinker.a": "model-00001-of-00003.safetensors",
        "thinker.b": "model-00002-of-00003.safetensors",
        "talker.a": "model-00002-of-00003.safetensors",
        "token2wav.a": "model-00003-of-00003.safetensors",
    }
    files = StageFiles(patterns=("*.json",), tensor_prefixes=("talker.",))
    assert needs_weight_map(files, listing) == "model.safetensors.index.json"
    assert select_files(files, listing, weight_map) == (
        "config.json",
        "model-00002-of-00003.safetensors",
        "model.safetensors.index.json",
    )
    with pytest.raises(StageFilesError, match="need the weight map"):
        select_files(files, listing)
    with pytest.raises(StageFilesError, match="no tensor"):
        select_files(StageFiles(tensor_prefixes=("vision.",)), listing, weight_map)
    broken = {**weight_map, "talker.b": "model-00009-of-00003.safetensors"}
    with pytest.raises(StageFilesError, match="lacks"):
        select_files(files, listing, broken)


def test_an_unsharded_checkpoint_is_needed_whole() -> None:
    listing = ["config.json", "model.safetensors", "spk_dict.pt"]
    files = StageFiles(patterns=("*.json",), tensor_prefixes=("thinker.",))
    assert needs_weight_map(files, listing) is None
    assert select_files(files, listing) == ("config.json", "model.safetensors")
    with pytest.raises(StageFilesError, match="need a checkpoint"):
        select_files(files, ["config.json"])


def test_every_preset_stage_says_which_files_it_reads() -> None:
    for preset in PRESETS.values():
        for stage in preset.stages:
            assert stage.files is not None, f"{preset.name}/{stage.name}"


def test_text_to_image_stages_split_the_tiny_repository() -> None:
    stages = {s.name: select_files(s.files, T2I_LAYOUT) for s in get_preset("text-to-image").stages}
    shared = {"model_index.json", "transformer/config.json", "vae/config.json"}
    assert set(stages["decode"]) == shared | {"vae/diffusion_pytorch_model.safetensors"}
    assert set(stages["denoise"]) == shared | {
        "transformer/diffusion_pytorch_model.safetensors",
        "scheduler/scheduler_config.json",
    }
    assert set(stages["encode"]) == shared | {
        "text_encoder/config.json",
        "text_encoder/generation_config.json",
        "text_encoder/model.safetensors",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    }
    total = sum(T2I_LAYOUT.values())
    fractions = {name: sum(T2I_LAYOUT[f] for f in files) / total for name, files in stages.items()}
    # The tiny model's VAE is its largest part (in Qwen-Image it is 0.4 %): the split is what matters.
    assert fractions["encode"] < 0.02
    assert fractions["denoise"] < 0.05
    assert 0.93 < fractions["decode"] < 0.94
    # Nothing a stage needs is left out of the union, and README/.gitattributes are nobody's.
    union = set().union(*stages.values())
    assert union == set(T2I_LAYOUT) - {".gitattributes", "README.md"}


def test_tts_stages_split_our_layout() -> None:
    layout = ["README.md", "speech.json", "acoustic/config.json", "acoustic/model.safetensors", "voices/default.npy"]
    layout += ["vocoder/config.json", "vocoder/model.safetensors"]
    stages = {s.name: select_files(s.files, layout) for s in get_preset("tts").stages}
    assert stages["vocoder"] == ("vocoder/config.json", "vocoder/model.safetensors")
    assert "vocoder/model.safetensors" not in stages["acoustic"]
    assert {"speech.json", "voices/default.npy", "acoustic/model.safetensors"} <= set(stages["acoustic"])


def test_files_travel_in_the_pipeline_file_and_can_be_overridden() -> None:
    preset = get_preset("text-to-image")
    override = {"decode": {"files": {"patterns": ["model_index.json", "vae/**"]}}}
    pipeline = preset.pipeline(ModelSource(source="hf://acme/m"), overrides=override)
    again = parse_pipeline(pipeline.to_json())
    assert again == pipeline
    assert again.stage("decode").files == StageFiles(patterns=("model_index.json", "vae/**"))
    assert again.stage("encode").files == preset.stages[0].files
    with pytest.raises(ValueError, match="files"):
        preset.pipeline(ModelSource(source="hf://acme/m"), overrides={"decode": {"files": {"patterns": []}}})
