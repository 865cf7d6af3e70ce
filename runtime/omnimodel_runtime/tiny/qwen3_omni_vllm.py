"""A tiny random-weight Qwen3-Omni (``qwen3_omni_moe``) with the geometry vLLM-Omni 0.30 hard-codes.

The ``qwen3-omni`` preset (this project's runtime) has a compact vocabulary; vLLM-Omni instead refers to
released ids and sizes in code, so this preset keeps them (all read from 0.30.0's
``model_executor/models/qwen3_omni/`` and ``stage_input_processors/qwen3_omni.py``):

- thinker special tokens at their released ids, 151643 (``<|endoftext|>``) to 151675 (``<|audio_pad|>``),
  under their released names (vLLM's processor writes ``<|audio_start|><|audio_pad|><|audio_end|>`` and
  kin as strings); the role words at their released ids, ``user`` 872, ``system`` 8948, ``assistant``
  77091 (the thinker → talker hand-off finds turns by those ids); thinker vocabulary 152064;
- talker codec vocabulary 3072 with the released control ids (pad 2148, bos 2149, end of speech 2150 —
  the pipeline's talker stop id —, nothink/think 2155–2157, voices 2301–2303), first-group codes below
  2048 (the hand-off to code2wav drops rows at or above 2048), the last 1024 ids suppressed but end of
  speech, and 16 code groups (code2wav's input is reshaped to 16 rows);
- a vision config with ``image_size`` and ``apply_vit_abs_pos_embed`` (vLLM sizes the position table as
  ``(image_size / patch_size)²``, which must equal transformers' ``num_position_embeddings``);
- every attention 32 wide (vLLM's CPU attention rejects 16), thinker and talker hidden sizes equal (the
  talker's profiling run reshapes thinker-sized embeddings by the talker's width).

Random-weight traps handled as in the ``qwen3-omni`` preset: the thinker's output rows of every token
but trained text are zeroed (readable random text); the talker's end-of-speech row is zeroed, so speech
runs to the talker's ``max_tokens`` (tests must cap it); the vocoder is scaled to an audible level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import torch
from transformers import PreTrainedTokenizerFast, Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
from transformers.utils import logging as hf_logging

from omnimodel_runtime.tiny.omni import TARGET_RMS, preprocessor_config
from omnimodel_runtime.tiny.omni_vllm_omni import tokenizer_at_ids
from omnimodel_runtime.tiny.text import ENDOFTEXT, IM_END, IM_START, _silence_unprintable

PRESET: Final = "qwen3-omni-vllm-omni"

# The released tokenizer's added tokens, by id (Qwen3-Omni-30B-A3B-Instruct's tokenizer_config.json).
SPECIAL_IDS: Final[dict[str, int]] = {
    name: 151643 + i
    for i, name in enumerate(
        (
            ENDOFTEXT,
            IM_START,
            IM_END,
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
            "<|audio_start|>",
            "<|audio_end|>",
            "<tts_pad>",
            "<tts_text_bos>",
            "<tts_text_eod>",
            "<tts_text_bos_single>",
            "<|audio_pad|>",
        )
    )
}
# Role words as single text tokens at the released ids (stage_input_processors/qwen3_omni.py:80-83).
ROLE_IDS: Final[dict[str, int]] = {"user": 872, "system": 8948, "assistant": 77091}
THINKER_VOCAB: Final = 152064
# The processor attributes the released tokenizer_config names (Qwen3OmniMoeProcessor reads them).
NAMED_TOKENS: Final[dict[str, str]] = {
    "audio_token": "<|audio_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}
# Qwen3-Omni's chat template without its default system prompt: media parts become their placeholder
# between markers, which the processor expands to one token per encoder output.
CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

HIDDEN: Final = 64  # thinker and talker alike
HEAD_DIM: Final = 32  # vLLM's CPU attention supports 32 and up
# Talker codec vocabulary, as released and as vLLM-Omni hard-codes it.
TALKER_VOCAB: Final = 3072
CODEBOOK: Final = 2048
CODE_GROUPS: Final = 16
CODEC_PAD, CODEC_BOS, CODEC_EOS = 2148, 2149, 2150
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = 2155, 2156, 2157
VOICES: Final[dict[str, int]] = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
IMAGE_SIZE, PATCH_SIZE = 128, 16


def build_tokenizer_at_released_ids(seed: int) -> tuple[PreTrainedTokenizerFast, list[int]]:
    """Qwen3-Omni's special tokens and role words at their released ids; the tokenizer and the ids of
    its trained (text) tokens (:func:`~omnimodel_runtime.tiny.omni_vllm_omni.tokenizer_at_ids`)."""
    tokenizer, text_ids = tokenizer_at_ids(seed, SPECIAL_IDS, NAMED_TOKENS, CHAT_TEMPLATE, pinned=ROLE_IDS)
    for role, want in ROLE_IDS.items():
        if tokenizer.encode(role, add_special_tokens=False) != [want]:
            raise RuntimeError(f"{role!r} does not encode to the single token {want}")
    return tokenizer, text_ids


def _config() -> Qwen3OmniMoeConfig:
    ids = SPECIAL_IDS
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1}
    # head_dim 32 → the interleaved M-RoPE sections sum to 16.
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [6, 5, 5], "interleaved": True}
    attention = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM}
    placeholders = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }
    thinker = {
        "text_config": {
            "vocab_size": THINKER_VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            **attention,
            "rope_parameters": rope,
            "max_position_embeddings": 32768,
            "initializer_range": 0.2,
            "eos_token_id": ids[IM_END],
            "norm_topk_prob": True,
            **moe,
        },
        "audio_config": {
            "num_mel_bins": 16,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 2 * HEAD_DIM,
            "output_dim": HIDDEN,
            "max_source_positions": 1500,
            "n_window": 50,  # the processor counts placeholders with the same window
            "n_window_infer": 400,
            "downsample_hidden_size": 16,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 2 * HEAD_DIM,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": HIDDEN,
            "patch_size": PATCH_SIZE,
            "image_size": IMAGE_SIZE,
            "num_position_embeddings": (IMAGE_SIZE // PATCH_SIZE) ** 2,
            "apply_vit_abs_pos_embed": True,
            "deepstack_visual_indexes": [0],
        },
        "user_token_id": ROLE_IDS["user"],
        **placeholders,
    }
    talker = {
        "text_config": {
            "vocab_size": TALKER_VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            # Read by the talker's MoE block but not declared by its config class (the released config has it).
            "shared_expert_intermediate_size": 64,
            "num_hidden_layers": 2,
            **attention,
            "rope_parameters": rope,
            "max_position_embeddings": 32768,
            "initializer_range": 0.2,
            "norm_topk_prob": False,
            **moe,
        },
        "code_predictor_config": {
            "vocab_size": CODEBOOK,
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            **attention,
            "max_position_embeddings": 64,
            "initializer_range": 0.2,
            "num_code_groups": CODE_GROUPS,
        },
        "num_code_groups": CODE_GROUPS,
        "thinker_hidden_size": HIDDEN,
        "accept_hidden_layer": 1,
        "speaker_id": VOICES,
        "spatial_merge_size": 2,
        "codec_pad_id": CODEC_PAD,
        "codec_bos_id": CODEC_BOS,
        "codec_eos_token_id": CODEC_EOS,
        "codec_nothink_id": CODEC_NOTHINK,
        "codec_think_bos_id": CODEC_THINK_BOS,
        "codec_think_eos_id": CODEC_THINK_EOS,
        **placeholders,
    }
    code2wav = {
        "codebook_size": CODEBOOK,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "num_quantizers": CODE_GROUPS,
        "decoder_dim": 64,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=ids[IM_START],
        im_end_token_id=ids[IM_END],
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=ROLE_IDS["system"],
        user_token_id=ROLE_IDS["user"],
        assistant_token_id=ROLE_IDS["assistant"],
    )


def _make_audible(model: Qwen3OmniMoeForConditionalGeneration, seed: int) -> None:
    """Scale the vocoder's last convolution so a probe utterance has :data:`TARGET_RMS` (its output is
    clamped to [-1, 1], so the level must stay well inside that)."""
    gen = torch.Generator().manual_seed(seed + 2)
    probe = torch.randint(0, CODEBOOK, (1, CODE_GROUPS, 24), generator=gen)
    with torch.no_grad():
        rms = float(model.code2wav(probe).float().pow(2).mean().sqrt())
        if rms == 0.0:
            raise RuntimeError("the tiny vocoder is silent")
        last = model.code2wav.decoder[-1].conv
        last.weight.mul_(TARGET_RMS / rms)
        if last.bias is not None:
            last.bias.mul_(TARGET_RMS / rms)


def build(out: Path, *, seed: int, size: str = "tiny", device: str = "cpu") -> None:
    """Write the checkpoint (``thinker.*``, ``talker.*``, ``code2wav.*``), tokenizer and processor config."""
    if size != "tiny":
        raise ValueError(f"unknown size {size!r} for preset {PRESET} (known: tiny)")
    hf_logging.disable_progress_bar()
    tokenizer, text_ids = build_tokenizer_at_released_ids(seed)
    config = _config()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        torch.manual_seed(seed)  # module initialisers draw from the global RNG
        with torch.device(device):
            model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    with torch.no_grad():
        # transformers leaves the talker's fused expert weights as allocated (torch.empty): drawn here,
        # seeded, so the same seed gives the same bytes.
        gen = torch.Generator(device=device).manual_seed(seed + 4)
        for layer in model.talker.model.layers:
            for param in layer.mlp.experts.parameters():
                param.normal_(0.0, 0.2, generator=gen)
        head = model.thinker.lm_head.weight
        # Wide logits keep greedy decoding from repeating one token (as in the text preset).
        head.normal_(0.0, 0.2, generator=torch.Generator(device=head.device).manual_seed(seed + 3))
        # Only trained text tokens and end of turn may be said: no padding, markup or placeholders.
        said = torch.zeros(head.shape[0], dtype=torch.bool, device=head.device)
        said[text_ids] = True
        head[~said] = 0.0
    _silence_unprintable(model.thinker, tokenizer)
    with torch.no_grad():
        head[SPECIAL_IDS[IM_END]].normal_(0.0, 0.2, generator=torch.Generator(device=head.device).manual_seed(seed + 5))
        # A zero end-of-speech row sits mid-ranking, where top-k sampling does not reach: speech runs to
        # max_tokens. Codes past the codebook are zeroed too, so every sampled code reaches code2wav.
        model.talker.codec_head.weight[CODEBOOK:] = 0.0
    _make_audible(model, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor = preprocessor_config(
        int(config.thinker_config.audio_config.num_mel_bins), "Qwen3OmniMoeProcessor", patch_size=PATCH_SIZE
    )
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(
        "Random-weight Qwen3OmniMoeForConditionalGeneration (tiny) with the token geometry vLLM-Omni expects, "
        f"built by `omnimodel make-tiny --preset {PRESET}` (seed {seed}); voices {', '.join(VOICES)}. "
        "Not a trained model: its text and audio are noise.\n"
    )
    (out / "omnimodel-build.json").write_text(json.dumps({"preset": PRESET, "seed": seed, "size": size}) + "\n")
