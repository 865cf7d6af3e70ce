"""The tiny Qwen2.5-Omni for vLLM-Omni keeps the token geometry vLLM-Omni 0.30 hard-codes.

vLLM-Omni looks up speaker rows 151870/151872 in the thinker embedding, builds talker prompts from the
codec controls 8292/8293/8294 and forwards every talker id below 8292 to the DiT. These tests pin that
geometry on the built files (loading in vLLM-Omni's own environment and serving it across three pods
is ``e2e/serving/test_vllm_omni_operator.py``, see docs/vllm-omni.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from omnimodel_runtime.tiny import build_tiny
from omnimodel_runtime.tiny.omni_vllm_omni import (
    CODEC_END,
    CODEC_PAD,
    CODEC_START,
    PRESET,
    SPEAKER_BOS,
    SPECIAL_IDS,
    TALKER_VOCAB,
    THINKER_VOCAB,
)

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(PRESET, tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.mark.slow
def test_vocabularies_and_control_ids_are_the_released_ones(model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    assert config.thinker_config.text_config.vocab_size == THINKER_VOCAB
    talker = config.talker_config
    assert talker.vocab_size == TALKER_VOCAB
    assert (
        (talker.tts_codec_pad_token_id, talker.tts_codec_start_token_id, talker.tts_codec_end_token_id)
        == (
            CODEC_PAD,
            CODEC_START,
            CODEC_END,
        )
        == (8292, 8293, 8294)
    )
    # Every id the talker may hand to code2wav (all below the pad id) has a DiT codec row.
    assert config.token2wav_config.dit_config.num_embeds >= CODEC_PAD
    thinker = config.thinker_config
    assert (thinker.audio_token_index, thinker.image_token_index, thinker.video_token_index) == (151646, 151655, 151656)


@pytest.mark.slow
def test_tokenizer_puts_special_tokens_at_released_ids(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_IDS} == SPECIAL_IDS
    assert len(tok) == max(SPECIAL_IDS.values()) + 1 <= THINKER_VOCAB
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False)
    assert ids.startswith("<|im_start|>user\nhello<|im_end|>")
    assert tok.image_token == "<|IMAGE|>"  # the processor finds its placeholders by these names
    assert tok.audio_token == "<|AUDIO|>"


@pytest.mark.slow
def test_speakers_processor_and_output_rows(model_dir: Path) -> None:
    speakers = torch.load(model_dir / "spk_dict.pt")
    assert {v: speakers[v]["bos_token"] for v in speakers} == SPEAKER_BOS == {"Ethan": 151870, "Chelsie": 151872}
    pre = json.loads((model_dir / "preprocessor_config.json").read_text())
    assert pre["processor_class"] == "Qwen2_5OmniProcessor"
    assert pre["feature_size"] == AutoConfig.from_pretrained(model_dir).thinker_config.audio_config.num_mel_bins
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        codec_head = f.get_tensor("talker.codec_head.weight")
        lm_head = f.get_tensor("thinker.lm_head.weight")
    # Control ids never win top-k sampling: speech always runs to the talker's max_tokens.
    assert codec_head.shape[0] == TALKER_VOCAB
    assert not codec_head[CODEC_PAD:].any()
    assert codec_head[:CODEC_PAD].abs().sum(dim=1).gt(0).all()
    # The thinker never says padding rows or placeholders, and can end its turn.
    assert not lm_head[SPECIAL_IDS["<|AUDIO|>"]].any()
    assert not lm_head[max(SPECIAL_IDS.values()) :].any()
    assert lm_head[SPECIAL_IDS["<|im_end|>"]].any()
