"""The tiny Qwen3-Omni for vLLM-Omni keeps the geometry vLLM-Omni 0.30 hard-codes.

vLLM-Omni finds turns by the role ids 872/8948/77091 after ``<|im_start|>`` 151644, writes media
placeholders as the released token strings, drops codec rows at or above 2048 before code2wav, reshapes
code2wav's input into 16 rows, stops the talker on 2150, and sizes the vision position table from
``image_size``. These tests pin that geometry on the built files (serving it with real vLLM-Omni
processes is ``e2e/serving/test_vllm_omni_qwen3.py``, see docs/vllm-omni.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from omnimodel_runtime.tiny import build_tiny
from omnimodel_runtime.tiny.qwen3_omni_vllm import PRESET, ROLE_IDS, SPECIAL_IDS

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(PRESET, tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.mark.slow
def test_tokens_sit_at_the_ids_vllm_omni_hard_codes(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_IDS} == SPECIAL_IDS
    assert (SPECIAL_IDS["<|im_start|>"], SPECIAL_IDS["<|audio_start|>"], SPECIAL_IDS["<|audio_pad|>"]) == (
        151644,
        151669,
        151675,
    )
    assert (SPECIAL_IDS["<tts_pad>"], SPECIAL_IDS["<tts_text_bos>"], SPECIAL_IDS["<tts_text_eod>"]) == (
        151671,
        151672,
        151673,
    )
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "hi"}, {"role": "user", "content": "hello"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    # The thinker → talker hand-off reads the token after each <|im_start|> as the role.
    roles = [ids[i + 1] for i, t in enumerate(ids) if t == 151644]
    assert roles == [ROLE_IDS["system"], ROLE_IDS["user"], ROLE_IDS["assistant"]] == [8948, 872, 77091]
    assert (tok.audio_token, tok.image_token, tok.video_token) == ("<|audio_pad|>", "<|image_pad|>", "<|video_pad|>")
    assert (tok.audio_bos_token, tok.vision_bos_token) == ("<|audio_start|>", "<|vision_start|>")


@pytest.mark.slow
def test_config_geometry(model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    thinker, talker, code2wav = config.thinker_config, config.talker_config, config.code2wav_config
    assert thinker.text_config.vocab_size > max(SPECIAL_IDS.values())
    vision = thinker.vision_config
    assert (vision.image_size // vision.patch_size) ** 2 == vision.num_position_embeddings
    assert vision.apply_vit_abs_pos_embed
    # vLLM's CPU attention needs head_dim >= 32, everywhere it runs attention.
    assert thinker.text_config.head_dim >= 32 and talker.text_config.head_dim >= 32
    assert talker.code_predictor_config.head_dim >= 32
    assert vision.hidden_size // vision.num_heads >= 32
    assert thinker.audio_config.d_model // thinker.audio_config.encoder_attention_heads >= 32
    assert talker.text_config.hidden_size == thinker.text_config.hidden_size == talker.thinker_hidden_size
    assert talker.text_config.vocab_size == 3072 and talker.codec_eos_token_id == 2150
    assert (talker.codec_pad_id, talker.codec_bos_id) == (2148, 2149)
    assert talker.num_code_groups == code2wav.num_quantizers == 16 and code2wav.codebook_size == 2048
    assert (config.system_token_id, config.user_token_id, config.assistant_token_id) == (8948, 872, 77091)
    pre = json.loads((model_dir / "preprocessor_config.json").read_text())
    assert pre["processor_class"] == "Qwen3OmniMoeProcessor" and pre["patch_size"] == vision.patch_size


@pytest.mark.slow
def test_output_rows(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        lm_head = f.get_tensor("thinker.lm_head.weight")
        codec_head = f.get_tensor("talker.codec_head.weight")
    # The thinker never says padding rows, placeholders or markup, and can end its turn.
    assert not lm_head[SPECIAL_IDS["<|audio_pad|>"]].any()
    assert not lm_head[tok.convert_tokens_to_ids("<|pad_5000|>")].any()
    assert not lm_head[max(SPECIAL_IDS.values()) :].any()
    assert lm_head[SPECIAL_IDS["<|im_end|>"]].any()
    # The talker samples only codes code2wav accepts, and never stops on its own.
    assert codec_head[:2048].abs().sum(dim=1).gt(0).all()
    assert not codec_head[2048:].any()
