"""A tiny random-weight Qwen3-TTS (``qwen3_tts``, CustomVoice) with the geometry vLLM-Omni 0.30 expects.

transformers has no Qwen3-TTS classes, so the checkpoint is written tensor by tensor, under the names and
shapes vLLM-Omni 0.30.0's loaders read (``model_executor/models/qwen3_tts/``), read from its code:

- ``config.json``: ``Qwen3TTSConfig`` (``model_type: qwen3_tts``, ``tts_model_type: custom_voice``, one
  speaker, ``vivian``), the text ids at their released values (``<|im_start|>`` 151644, ``<tts_pad>``
  151671, ``<tts_text_bos>`` 151672, ``<tts_text_eod>`` 151673, ``assistant`` 77091: the prompt builder
  embeds them), the talker's codec vocabulary 3072 with the released control ids (pad 2148, bos 2149, end
  of speech 2150 — the pipeline's stop id —, think 2154–2157, language ids 2050/2055, the speaker at 3000),
  16 code groups on a 2048-entry codebook, text vocabulary 151936, multimodal rotary sections summing to
  half of head_dim 32 (vLLM's CPU attention rejects 16);
- ``model.safetensors``: the talker (``talker.model.*`` Qwen3 layers, ``codec_embedding``, ``text_embedding``,
  ``text_projection``, ``codec_head``) and its code predictor (15 embeddings and heads);
- a text tokenizer: the ``qwen3-omni-vllm-omni`` preset's (the same released special ids);
- ``speech_tokenizer/``: the 12 Hz tokenizer (``Qwen3TTSTokenizerV2Config``): a Mimi encoder (transformers'
  ``MimiModel`` without its decoder half, as vLLM-Omni's ``Qwen3TTSTokenizerV2Encoder`` is; the talker
  loads it for voice cloning) and the decoder code2wav runs (split RVQ, a pre-transformer, two ConvNeXt
  upsamplers, a 4-block vocoder: 8·5·4·3·2·2 = 1920 samples per code frame, 24 kHz), with Mimi's feature
  extractor config.

Random-weight traps: codebooks are ``embedding_sum / cluster_usage``, so both are set (zero sums would
decode every code to silence); the talker's end-of-speech row is zeroed, so speech runs to the talker's
``max_tokens`` (tests must cap it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import save_file
from transformers import MimiConfig, MimiModel
from transformers.utils import logging as hf_logging

from omnimodel_runtime.tiny.qwen3_omni_vllm import build_tokenizer_at_released_ids

PRESET: Final = "tts-qwen3-vllm-omni"
SPEAKER: Final = "vivian"

HIDDEN: Final = 64  # talker and code predictor
HEAD_DIM: Final = 32  # vLLM's CPU attention supports 32 and up
TEXT_HIDDEN: Final = 32
TEXT_VOCAB: Final = 151936
TALKER_VOCAB: Final = 3072
CODEBOOK: Final = 2048
CODE_GROUPS: Final = 16
CODEC_IDS: Final[dict[str, int]] = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
TEXT_IDS: Final[dict[str, int]] = {
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
    "assistant_token_id": 77091,
}
# The speech tokenizer's decoder: every width 32 (so the pre-transformer, latent and vocoder input agree),
# codebook vectors half of codebook_dim (the split RVQ projects codebook_dim to codebook_dim / 2).
DECODER_DIM: Final = 32
CODEBOOK_DIM: Final = 64
UPSAMPLE_RATES: Final = (8, 5, 4, 3)
UPSAMPLING_RATIOS: Final = (2, 2)
SAMPLE_RATE: Final = 24000


def talker_config() -> dict[str, Any]:
    predictor = {
        "vocab_size": CODEBOOK,
        "hidden_size": HIDDEN,
        "intermediate_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "num_code_groups": CODE_GROUPS,
        "max_position_embeddings": 65536,
        "rope_theta": 1000000,
    }
    return {
        "vocab_size": TALKER_VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "text_vocab_size": TEXT_VOCAB,
        "text_hidden_size": TEXT_HIDDEN,
        "num_code_groups": CODE_GROUPS,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000,
        "position_id_per_seconds": 13,
        # Interleaved multimodal rotary: the sections cover head_dim / 2 (the released 24/20/20 of 128).
        "rope_scaling": {"interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default", "type": "default"},
        **CODEC_IDS,
        "codec_language_id": {"chinese": 2055, "english": 2050},
        "spk_id": {SPEAKER: 3000},
        "spk_is_dialect": {SPEAKER: False},
        "code_predictor_config": predictor,
    }


def speech_tokenizer_config() -> dict[str, Any]:
    # Mimi's encoder at a 12.5 Hz frame rate (24 kHz / 1920): its conv widths must reach hidden_size
    # (num_filters · 2^4) and its upsampler's groups divide it.
    encoder = MimiConfig(
        hidden_size=64,
        num_filters=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=64,
        codebook_size=CODEBOOK,
        codebook_dim=CODEBOOK_DIM,
        num_quantizers=32,
        num_semantic_quantizers=1,
        sampling_rate=SAMPLE_RATE,
        frame_rate=12.5,
        upsampling_ratios=[8, 6, 5, 4],
        upsample_groups=64,
        use_streaming=False,
    )
    decoder = {
        "codebook_size": CODEBOOK,
        "codebook_dim": CODEBOOK_DIM,
        "hidden_size": DECODER_DIM,
        "latent_dim": DECODER_DIM,
        "decoder_dim": DECODER_DIM,
        "intermediate_size": DECODER_DIM,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "num_quantizers": CODE_GROUPS,
        "upsample_rates": list(UPSAMPLE_RATES),
        "upsampling_ratios": list(UPSAMPLING_RATIOS),
        "sliding_window": 72,
    }
    return {
        "model_type": "qwen3_tts_tokenizer_12hz",
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "encoder_config": encoder.to_dict(),
        "decoder_config": decoder,
        "encoder_valid_num_quantizers": CODE_GROUPS,
        "input_sample_rate": SAMPLE_RATE,
        "output_sample_rate": SAMPLE_RATE,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
    }


def _rand(*shape: int, std: float = 0.02) -> torch.Tensor:
    return torch.randn(*shape) * std


def _qwen3_layer(out: dict[str, torch.Tensor], prefix: str, hidden: int, heads: int, kv_heads: int) -> None:
    """One Qwen3 decoder layer under Hugging Face's names (vLLM fuses q/k/v and gate/up when loading)."""
    out[f"{prefix}.self_attn.q_proj.weight"] = _rand(heads * HEAD_DIM, hidden)
    out[f"{prefix}.self_attn.k_proj.weight"] = _rand(kv_heads * HEAD_DIM, hidden)
    out[f"{prefix}.self_attn.v_proj.weight"] = _rand(kv_heads * HEAD_DIM, hidden)
    out[f"{prefix}.self_attn.o_proj.weight"] = _rand(hidden, heads * HEAD_DIM)
    out[f"{prefix}.self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
    out[f"{prefix}.self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
    out[f"{prefix}.mlp.gate_proj.weight"] = _rand(HIDDEN, hidden)
    out[f"{prefix}.mlp.up_proj.weight"] = _rand(HIDDEN, hidden)
    out[f"{prefix}.mlp.down_proj.weight"] = _rand(hidden, HIDDEN)
    out[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
    out[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)


def talker_weights() -> dict[str, torch.Tensor]:
    """``talker.*`` as Qwen3TTSTalkerForConditionalGeneration's weight mapper reads them."""
    w: dict[str, torch.Tensor] = {}
    _qwen3_layer(w, "talker.model.layers.0", HIDDEN, 2, 1)
    w["talker.model.norm.weight"] = torch.ones(HIDDEN)
    w["talker.model.codec_embedding.weight"] = _rand(TALKER_VOCAB, HIDDEN)
    w["talker.model.text_embedding.weight"] = _rand(TEXT_VOCAB, TEXT_HIDDEN)
    head = _rand(TALKER_VOCAB, HIDDEN)
    head[CODEC_IDS["codec_eos_token_id"]] = 0  # never a clear end of speech: runs to max_tokens
    w["talker.codec_head.weight"] = head
    w["talker.text_projection.linear_fc1.weight"] = _rand(TEXT_HIDDEN, TEXT_HIDDEN)
    w["talker.text_projection.linear_fc1.bias"] = torch.zeros(TEXT_HIDDEN)
    w["talker.text_projection.linear_fc2.weight"] = _rand(HIDDEN, TEXT_HIDDEN)
    w["talker.text_projection.linear_fc2.bias"] = torch.zeros(HIDDEN)
    _qwen3_layer(w, "talker.code_predictor.model.layers.0", HIDDEN, 2, 1)
    w["talker.code_predictor.model.norm.weight"] = torch.ones(HIDDEN)
    for group in range(CODE_GROUPS - 1):
        w[f"talker.code_predictor.model.codec_embedding.{group}.weight"] = _rand(CODEBOOK, HIDDEN)
        w[f"talker.code_predictor.lm_head.{group}.weight"] = _rand(CODEBOOK, HIDDEN)
    return w


def _conv(w: dict[str, torch.Tensor], prefix: str, out_ch: int, in_ch: int, kernel: int) -> None:
    w[f"{prefix}.weight"] = _rand(out_ch, in_ch, kernel, std=(1.0 / (in_ch * kernel)) ** 0.5)
    w[f"{prefix}.bias"] = torch.zeros(out_ch)


def _snake(w: dict[str, torch.Tensor], prefix: str, channels: int) -> None:
    w[f"{prefix}.alpha"] = torch.zeros(channels)  # SnakeBeta keeps log-scale parameters: 0 is alpha = beta = 1
    w[f"{prefix}.beta"] = torch.zeros(channels)


def _codebooks(w: dict[str, torch.Tensor], prefix: str, count: int) -> None:
    w[f"{prefix}.input_proj.weight"] = _rand(CODEBOOK_DIM // 2, CODEBOOK_DIM, 1, std=0.1)
    w[f"{prefix}.output_proj.weight"] = _rand(CODEBOOK_DIM, CODEBOOK_DIM // 2, 1, std=0.1)
    for layer in range(count):
        w[f"{prefix}.vq.layers.{layer}._codebook.cluster_usage"] = torch.ones(CODEBOOK)
        w[f"{prefix}.vq.layers.{layer}._codebook.embedding_sum"] = torch.randn(CODEBOOK, CODEBOOK_DIM // 2)


def decoder_weights() -> dict[str, torch.Tensor]:
    """``decoder.*`` of the 12 Hz speech tokenizer (Qwen3TTSTokenizerV2Decoder), every width DECODER_DIM."""
    d = DECODER_DIM
    w: dict[str, torch.Tensor] = {}
    _codebooks(w, "decoder.quantizer.rvq_first", 1)
    _codebooks(w, "decoder.quantizer.rvq_rest", CODE_GROUPS - 1)
    _conv(w, "decoder.pre_conv.conv", d, CODEBOOK_DIM, 3)
    t = "decoder.pre_transformer"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w[f"{t}.layers.0.self_attn.{name}.weight"] = _rand(d, d, std=0.1)
    for name in ("gate_proj", "up_proj", "down_proj"):
        w[f"{t}.layers.0.mlp.{name}.weight"] = _rand(d, d, std=0.1)
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "norm.weight"):
        w[f"{t}.layers.0.{name}" if "layernorm" in name else f"{t}.{name}"] = torch.ones(d)
    w[f"{t}.layers.0.self_attn_layer_scale.scale"] = torch.full((d,), 0.01)
    w[f"{t}.layers.0.mlp_layer_scale.scale"] = torch.full((d,), 0.01)
    for name in ("input_proj", "output_proj"):
        w[f"{t}.{name}.weight"] = _rand(d, d, std=0.1)
        w[f"{t}.{name}.bias"] = torch.zeros(d)
    for i, ratio in enumerate(UPSAMPLING_RATIOS):
        u = f"decoder.upsample.{i}"
        w[f"{u}.0.conv.weight"] = _rand(d, d, ratio, std=(1.0 / d) ** 0.5)
        w[f"{u}.0.conv.bias"] = torch.zeros(d)
        w[f"{u}.1.gamma"] = torch.full((d,), 0.01)
        _conv(w, f"{u}.1.dwconv.conv", d, 1, 7)
        w[f"{u}.1.norm.weight"] = torch.ones(d)
        w[f"{u}.1.norm.bias"] = torch.zeros(d)
        w[f"{u}.1.pwconv1.weight"] = _rand(4 * d, d, std=0.1)
        w[f"{u}.1.pwconv1.bias"] = torch.zeros(4 * d)
        w[f"{u}.1.pwconv2.weight"] = _rand(d, 4 * d, std=0.1)
        w[f"{u}.1.pwconv2.bias"] = torch.zeros(d)
    _conv(w, "decoder.decoder.0.conv", d, d, 7)
    channels = d
    for block, rate in enumerate(UPSAMPLE_RATES, start=1):
        b, out_ch = f"decoder.decoder.{block}.block", channels // 2
        _snake(w, f"{b}.0", channels)
        w[f"{b}.1.conv.weight"] = _rand(channels, out_ch, 2 * rate, std=(1.0 / channels) ** 0.5)  # transposed
        w[f"{b}.1.conv.bias"] = torch.zeros(out_ch)
        for unit in (2, 3, 4):
            _snake(w, f"{b}.{unit}.act1", out_ch)
            _conv(w, f"{b}.{unit}.conv1.conv", out_ch, out_ch, 7)
            _snake(w, f"{b}.{unit}.act2", out_ch)
            _conv(w, f"{b}.{unit}.conv2.conv", out_ch, out_ch, 1)
        channels = out_ch
    _snake(w, f"decoder.decoder.{len(UPSAMPLE_RATES) + 1}", channels)
    _conv(w, f"decoder.decoder.{len(UPSAMPLE_RATES) + 2}.conv", 1, channels, 7)
    return w


def encoder_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``encoder.*``: a random Mimi without the decoder half vLLM-Omni's encoder class drops."""
    mimi = MimiModel(MimiConfig(**config["encoder_config"])).eval()
    dropped = ("upsample.", "decoder_transformer.", "decoder.")
    return {f"encoder.{k}": v for k, v in mimi.state_dict().items() if not k.startswith(dropped)}


def build(out: Path, *, seed: int) -> None:
    """Write a random-weight Qwen3-TTS CustomVoice checkpoint for vLLM-Omni into ``out``."""
    hf_logging.disable_progress_bar()
    tokenizer, _ = build_tokenizer_at_released_ids(seed)
    tokenizer.save_pretrained(out)
    config = {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tts_model_type": "custom_voice",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": "tiny",
        **TEXT_IDS,
        "talker_config": talker_config(),
        "speaker_encoder_config": {"enc_dim": HIDDEN, "sample_rate": SAMPLE_RATE},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    torch.manual_seed(seed)
    save_file({k: v.contiguous() for k, v in talker_weights().items()}, out / "model.safetensors")
    speech = out / "speech_tokenizer"
    speech.mkdir(exist_ok=True)
    speech_config = speech_tokenizer_config()
    (speech / "config.json").write_text(json.dumps(speech_config, indent=2) + "\n")
    torch.manual_seed(seed)
    weights = {**encoder_weights(speech_config), **decoder_weights()}
    save_file({k: v.contiguous() for k, v in weights.items()}, speech / "model.safetensors")
    feature_extractor = {
        "feature_extractor_type": "EncodecFeatureExtractor",
        "feature_size": 1,
        "sampling_rate": SAMPLE_RATE,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "chunk_length_s": None,
        "overlap": None,
    }
    (speech / "preprocessor_config.json").write_text(json.dumps(feature_extractor, indent=2) + "\n")
    (out / "README.md").write_text(
        f"Random-weight Qwen3-TTS (CustomVoice, speaker {SPEAKER!r}, tiny) built by `omnimodel make-tiny --preset "
        f"{PRESET}` (seed {seed}). Not a trained model: its speech is noise.\n"
    )
    (out / "omnimodel-build.json").write_text(json.dumps({"preset": PRESET, "seed": seed}) + "\n")
