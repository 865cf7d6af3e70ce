"""The tiny Qwen3-TTS for vLLM-Omni keeps the geometry vLLM-Omni 0.30's qwen3_tts stages read.

vLLM-Omni's prompt builder embeds the text ids 151644/151671-151673 and the assistant id 77091, restricts
the talker to codes below 2048 plus end of speech 2150 (the pipeline's stop id), reshapes code2wav's input
into 16 rows, and decodes 1920 samples per code frame at 24 kHz. Serving it with real vLLM-Omni processes
is ``e2e/serving/test_vllm_omni_tts_video.py`` (docs/vllm-omni.md); that vLLM-Omni's own classes accept
every tensor name and shape was checked in its environment when the builder was written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from omnimodel_runtime.tiny import build_tiny
from omnimodel_runtime.tiny.qwen3_tts_vllm import PRESET, SPEAKER

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(PRESET, tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.mark.slow
def test_text_ids_sit_where_vllm_omni_reads_them(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["tts_model_type"]) == ("qwen3_tts", "custom_voice")
    tok = AutoTokenizer.from_pretrained(model_dir)
    for token, key in (
        ("<|im_start|>", "im_start_token_id"),
        ("<|im_end|>", "im_end_token_id"),
        ("<tts_pad>", "tts_pad_token_id"),
        ("<tts_text_bos>", "tts_bos_token_id"),
        ("<tts_text_eod>", "tts_eos_token_id"),
    ):
        assert tok.convert_tokens_to_ids(token) == config[key], token
    assert (config["im_start_token_id"], config["tts_pad_token_id"], config["assistant_token_id"]) == (
        151644,
        151671,
        77091,
    )
    assert config["talker_config"]["text_vocab_size"] > max(tok.get_vocab().values())


def test_talker_geometry(model_dir: Path) -> None:
    talker = json.loads((model_dir / "config.json").read_text())["talker_config"]
    assert (talker["vocab_size"], talker["codec_eos_token_id"], talker["codec_pad_id"]) == (3072, 2150, 2148)
    assert talker["code_predictor_config"]["vocab_size"] == 2048 and talker["num_code_groups"] == 16
    assert talker["head_dim"] >= 32 and talker["code_predictor_config"]["head_dim"] >= 32
    assert sum(talker["rope_scaling"]["mrope_section"]) == talker["head_dim"] // 2
    assert list(talker["spk_id"]) == [SPEAKER] and talker["spk_id"][SPEAKER] < talker["vocab_size"]
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_slice("talker.model.text_embedding.weight").get_shape()) == (151936, 32)
        assert not f.get_tensor("talker.codec_head.weight")[2150].any()  # no clear end of speech
    assert {n for n in names if ".lm_head." in n} == {f"talker.code_predictor.lm_head.{g}.weight" for g in range(15)}


def test_speech_tokenizer_decodes_1920_samples_a_frame_from_live_codebooks(model_dir: Path) -> None:
    speech = model_dir / "speech_tokenizer"
    config = json.loads((speech / "config.json").read_text())
    decoder = config["decoder_config"]
    assert math.prod(decoder["upsample_rates"]) * math.prod(decoder["upsampling_ratios"]) == 1920
    assert config["decode_upsample_rate"] == config["encode_downsample_rate"] == 1920
    assert config["output_sample_rate"] == config["encoder_config"]["sampling_rate"] == 24000
    assert decoder["num_quantizers"] == config["encoder_valid_num_quantizers"] == 16
    with safe_open(speech / "model.safetensors", "pt") as f:
        names = set(f.keys())
        books = [k for k in names if k.endswith("_codebook.embedding_sum") and k.startswith("decoder.")]
        assert len(books) == 16
        assert all(f.get_tensor(k).abs().sum() > 0 for k in books), "a zero codebook decodes to silence"
        assert any(k.startswith("encoder.encoder.") for k in names)
        assert not any(k.startswith(("encoder.decoder.", "encoder.upsample.")) for k in names)
    assert json.loads((speech / "preprocessor_config.json").read_text())["sampling_rate"] == 24000
