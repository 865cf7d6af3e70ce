"""The tiny Wan2.2 TI2V-5B for vLLM-Omni keeps what vLLM-Omni 0.30's Wan2.2 pipeline reads from a checkpoint.

``diffusion/models/wan2_2/pipeline_wan2_2.py`` takes TI2V-5B's path (one timestep per latent patch, one
expert) from ``expand_timesteps`` in ``model_index.json`` and the absence of a ``transformer_2`` folder,
and snaps sizes to the VAE's spatial factor times the transformer's patch (16 × 2 = 32). Serving it with
real vLLM-Omni processes is ``e2e/serving/test_vllm_omni_tts_video.py`` (docs/vllm-omni.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline

from omnimodel_runtime.tiny import build_tiny
from omnimodel_runtime.tiny.wan22_vllm import LATENT_CHANNELS, PRESET

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(PRESET, tmp_path_factory.mktemp("tiny") / "m", seed=0)


def read(path: Path) -> dict[str, object]:
    loaded: dict[str, object] = json.loads(path.read_text())
    return loaded


@pytest.mark.slow
def test_the_checkpoint_says_ti2v_5b(model_dir: Path) -> None:
    index = read(model_dir / "model_index.json")
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    assert index["transformer_2"] == [None, None] and not (model_dir / "transformer_2").exists()
    transformer = read(model_dir / "transformer" / "config.json")
    assert (transformer["in_channels"], transformer["out_channels"]) == (LATENT_CHANNELS, LATENT_CHANNELS) == (48, 48)
    assert transformer["patch_size"] == [1, 2, 2]
    assert transformer["text_dim"] == read(model_dir / "text_encoder" / "config.json")["d_model"]
    vae = read(model_dir / "vae" / "config.json")
    assert (vae["z_dim"], vae["is_residual"], vae["patch_size"], vae["in_channels"]) == (48, True, 2, 12)
    assert (vae["scale_factor_spatial"], vae["scale_factor_temporal"]) == (16, 4)
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 48  # type: ignore[arg-type]


@pytest.mark.slow
def test_diffusers_makes_a_video_of_the_asked_size(model_dir: Path) -> None:
    """Loadable as the released checkpoint is: 5 frames (4k + 1) of 32 × 64 pixels, not constant."""
    pipe = WanPipeline.from_pretrained(model_dir)
    frames = pipe(
        "a fox running",
        height=32,
        width=64,
        num_frames=5,
        num_inference_steps=2,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert tuple(frames.shape) == (1, 5, 3, 32, 64)
    assert float(frames.std()) > 0
