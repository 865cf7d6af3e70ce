"""The tiny model of the ``qwen3-omni`` preset: a random-weight ``Qwen3OmniMoeForConditionalGeneration``.

One full checkpoint laid out like the released one (``thinker.*``, ``talker.*`` — with its code predictor —
and ``code2wav.*`` weights in ``model.safetensors``, tokenizer, chat template with the Qwen3 placeholders
``<|audio_pad|>``/``<|image_pad|>``/``<|video_pad|>``, ``preprocessor_config.json`` for
``Qwen3OmniMoeProcessor``), so the stage engines load their part from it exactly as they would load
Qwen3-Omni-30B-A3B. The voices are codec ids in the talker
config (``talker_config.speaker_id``), as released: there is no speaker file.

Sizes honour the architecture's constraints (checked by running the whole model's ``generate()``):

- ``sum(mrope_section) == head_dim / 2`` for the thinker's and the talker's text models (interleaved M-RoPE);
- the talker's ``generate()`` suppresses the last 1024 ids of its codec vocabulary except end-of-speech, so
  the vocabulary is ``codes + 1024`` and every control id (pad, bos, eos, think ids, speakers) lies in that
  suppressed tail — a vocabulary of 1024 or less leaves end-of-speech as the only id it can sample;
- ``talker.num_code_groups == code2wav.num_quantizers`` and every code (first group from the talker, the
  others from the code predictor) is below ``code2wav.codebook_size``;
- the code predictor's hidden size equals the talker's (it continues from the talker's last hidden state);
- ``talker.thinker_hidden_size`` equals the thinker's hidden size; ``accept_hidden_layer`` is at most the
  thinker's layer count;
- the audio encoder's ``n_window`` is the processor's (it counts an audio's placeholders with its own,
  50 by default), and the image processor's ``patch_size`` the vision encoder's (16).

The vocoder keeps the released geometry (upsampling 8·5·4·3 then 2·2: 1920 samples per code at 24 kHz,
12.5 codes per second; sliding window 72). Random-weight traps handled: the thinker's output head is
widened and its unprintable/special rows zeroed (readable random text, as in the other omni preset); the
talker's end-of-speech row is zeroed so utterances run to the tiny cap of codes; the vocoder's output conv
is scaled to an audible level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
from transformers.utils import logging as hf_logging

from omnimodel_runtime.layout import OMNI_GENERATION_FILE
from omnimodel_runtime.tiny.omni import (
    AUDIO_BOS,
    MARKERS,
    TARGET_RMS,
    TTS_PAD,
    TTS_TEXT_BOS,
    TTS_TEXT_EOD,
    VISION_BOS,
    _tokenizer,
    preprocessor_config,
)
from omnimodel_runtime.tiny.text import IM_END, IM_START, _silence_unprintable

PRESET: Final = "qwen3-omni"
# The released tokenizer's placeholder names (Qwen3-Omni renamed Qwen2.5-Omni's <|AUDIO|> and kin).
AUDIO_PAD, IMAGE_PAD, VIDEO_PAD = "<|audio_pad|>", "<|image_pad|>", "<|video_pad|>"
EXTRA_TOKENS: Final = (AUDIO_PAD, IMAGE_PAD, VIDEO_PAD, *MARKERS)
# The released voices (talker_config.speaker_id); the whole model's generate() defaults to Ethan.
VOICES: Final = ("Ethan", "Chelsie", "Aiden")

THINKER_HIDDEN: Final = 64
CODES: Final = 64  # first-group codes 0..63; the controls follow in the suppressed tail
SUPPRESSED_TAIL: Final = 1024  # the whole model's generate() suppresses the last 1024 codec ids
CODE_GROUPS: Final = 4
# The tiny talker rarely samples end-of-speech (see build): 24 codes = 1.92 s of audio.
TINY_GENERATION: Final[dict[str, Any]] = {"talker": {"max_new_tokens": 24}}
# size="qwen3-omni-30b-a3b": Qwen3-Omni-30B-A3B's sizes with random bfloat16 weights, for accelerator
# benchmarks; 144 codes = 11.5 s of speech per answer (the random talker never ends speech on its own).
REAL_SIZE: Final = "qwen3-omni-30b-a3b"
REAL_CODES: Final = 2048
REAL_GENERATION: Final[dict[str, Any]] = {"talker": {"max_new_tokens": 144}}
SIZES: Final = ("tiny", REAL_SIZE)


def _real(config: dict[str, Any]) -> dict[str, Any]:
    """The tiny config's dicts at Qwen3-Omni-30B-A3B's sizes (thinker 2048 × 48 MoE layers of 128 experts,
    8 a token; talker 1024 × 20 MoE layers, 6 of 128 experts and a shared one; code predictor 5 layers,
    16 code groups of 2048 codes; code2wav 8 layers). From the released architecture as recalled here, not
    checked against its config.json: the compute is of that size, its figures are not the release's."""
    thinker, talker, code2wav = config["thinker_config"], config["talker_config"], config["code2wav_config"]
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20], "interleaved": True}
    thinker["text_config"].update(
        vocab_size=151936, hidden_size=2048, intermediate_size=768, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, rope_parameters=mrope, max_position_embeddings=65536, initializer_range=0.02,
    )  # fmt: skip
    thinker["audio_config"].update(
        num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120, d_model=1280,
        output_dim=2048, max_source_positions=1500, n_window_infer=800, downsample_hidden_size=480,
    )  # fmt: skip
    thinker["vision_config"].update(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
        num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
    )  # fmt: skip
    talker["text_config"].update(
        vocab_size=REAL_CODES + SUPPRESSED_TAIL, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384,
        shared_expert_intermediate_size=768, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=2,
        head_dim=128, num_experts=128, num_experts_per_tok=6, rope_parameters=mrope, max_position_embeddings=65536,
        initializer_range=0.02,
    )  # fmt: skip
    talker["code_predictor_config"].update(
        vocab_size=REAL_CODES, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=65536, initializer_range=0.02,
        num_code_groups=16,
    )  # fmt: skip
    talker.update(num_code_groups=16, thinker_hidden_size=2048, accept_hidden_layer=24)
    code2wav.update(
        codebook_size=REAL_CODES, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=16, num_quantizers=16, decoder_dim=1536,
    )  # fmt: skip
    return config


def _config(ids: dict[str, int], vocab: int, *, real: bool = False) -> Qwen3OmniMoeConfig:
    h = 2048 if real else THINKER_HIDDEN
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True}
    text = {
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        # head_dim 32 -> M-RoPE sections sum to 16 (the released model interleaves them).
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [6, 5, 5],
            "interleaved": True,
        },
        "max_position_embeddings": 4096,
        "initializer_range": 0.2,
        "eos_token_id": ids[IM_END],
        **moe,
    }
    placeholders = {
        "audio_token_id": ids[AUDIO_PAD],
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "audio_start_token_id": ids[AUDIO_BOS],
        # get_rope_index reads it from the thinker config too, which does not declare it.
        "vision_start_token_id": ids[VISION_BOS],
    }
    thinker = {
        "text_config": text,
        "audio_config": {
            "num_mel_bins": 16,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "d_model": 16,
            "output_dim": h,
            "max_source_positions": 100,
            # transformers' default window (chunks of 100 mel frames): Qwen3OmniMoeProcessor counts each audio's
            # placeholders with its own n_window (50 unless told otherwise), which must agree.
            "n_window": 50,
            "n_window_infer": 200,
            "downsample_hidden_size": 8,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": h,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        "user_token_id": ids["user"],
        **placeholders,
    }
    c = REAL_CODES if real else CODES
    codec = {
        "codec_pad_id": c,
        "codec_bos_id": c + 1,
        "codec_eos_token_id": c + 2,
        "codec_nothink_id": c + 3,
        "codec_think_bos_id": c + 4,
        "codec_think_eos_id": c + 5,
    }
    talker = {
        "text_config": {
            "vocab_size": c + SUPPRESSED_TAIL,
            "hidden_size": 32,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            # Read by the talker's MoE block but not declared by its config class (the released config.json
            # carries it).
            "shared_expert_intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [3, 3, 2],
                "interleaved": True,
            },
            "max_position_embeddings": 4096,
            "initializer_range": 0.2,
            **moe,
            "norm_topk_prob": False,
        },
        "code_predictor_config": {
            "vocab_size": c,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 64,
            "initializer_range": 0.2,
            "num_code_groups": CODE_GROUPS,
        },
        "num_code_groups": CODE_GROUPS,
        "thinker_hidden_size": h,
        # The talker reads the thinker's hidden state after this layer at audio/image positions: a middle
        # layer, as in transformers' default config (18 of 28): a layer's own output, not the final-normed one.
        "accept_hidden_layer": 1,
        "speaker_id": {v.lower(): c + 6 + i for i, v in enumerate(VOICES)},
        # Read by the talker but not declared by its config class (the released config.json carries it).
        "spatial_merge_size": 2,
        **codec,
        **placeholders,
    }
    code2wav = {
        "codebook_size": c,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_quantizers": CODE_GROUPS,
        "decoder_dim": 64,
    }
    parts = {"thinker_config": thinker, "talker_config": talker, "code2wav_config": code2wav}
    return Qwen3OmniMoeConfig(
        **(_real(parts) if real else parts),
        im_start_token_id=ids[IM_START],
        im_end_token_id=ids[IM_END],
        tts_pad_token_id=ids[TTS_PAD],
        tts_bos_token_id=ids[TTS_TEXT_BOS],
        tts_eos_token_id=ids[TTS_TEXT_EOD],
        system_token_id=ids["system"],
        user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
    )


def _token_id(tokenizer: Any, text: str) -> int:
    """The one id ``text`` encodes to (the roles must be single tokens: the whole model finds user and
    assistant turns by the token after ``<|im_start|>``)."""
    encoded = tokenizer.encode(text, add_special_tokens=False)
    if len(encoded) != 1:
        raise RuntimeError(f"the tiny tokenizer splits {text!r} into {encoded}; it must be one token")
    return int(encoded[0])


def _make_audible(model: Qwen3OmniMoeForConditionalGeneration, seed: int) -> None:
    """Scale the vocoder's last convolution so a probe utterance has :data:`TARGET_RMS` (its output is
    clamped to [-1, 1], so the level must stay well inside that)."""
    code2wav = model.code2wav
    gen = torch.Generator().manual_seed(seed + 2)
    # Every quantizer's codes (4 tiny, 16 at real size), drawn on the CPU (the same bytes either way) and
    # sent to where the model was built.
    groups = int(code2wav.config.num_quantizers)
    device = next(code2wav.parameters()).device
    probe = torch.randint(0, CODES, (1, groups, 24), generator=gen).to(device)
    with torch.no_grad():
        rms = float(code2wav(probe).float().pow(2).mean().sqrt())
        if rms == 0.0:
            raise RuntimeError("the tiny vocoder is silent")
        last = code2wav.decoder[-1].conv
        last.weight.mul_(TARGET_RMS / rms)
        if last.bias is not None:
            last.bias.mul_(TARGET_RMS / rms)


def build(out: Path, *, seed: int, size: str = "tiny", device: str = "cpu") -> None:
    """Write a random-weight Qwen3-Omni checkpoint (MoE thinker, talker with code predictor, code2wav)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for preset {PRESET} (known: {', '.join(SIZES)})")
    real = size == REAL_SIZE
    hf_logging.disable_progress_bar()
    tokenizer = _tokenizer(seed, EXTRA_TOKENS, (AUDIO_PAD, IMAGE_PAD, VIDEO_PAD))
    ids = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in (*EXTRA_TOKENS, IM_START, IM_END)}
    ids.update({role: _token_id(tokenizer, role) for role in ("system", "user", "assistant")})
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        config = _config(ids, len(tokenizer), real=real)
        # Module initialisers draw from the global RNG: the same seed must give the same bytes.
        torch.manual_seed(seed)
        # At real size built in bfloat16 from the start, as released: float32 would not fit an 80 GB GPU.
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16 if real else dtype)
        try:
            with torch.device(device):
                model = Qwen3OmniMoeForConditionalGeneration(config).eval()
        finally:
            torch.set_default_dtype(dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    with torch.no_grad():
        # transformers 5.19's init leaves the talker's fused expert weights as allocated (torch.empty):
        # whatever memory held, different on every build. Drawn here, seeded, at the talker's init scale.
        gen = torch.Generator(device=device).manual_seed(seed + 4)
        std = float(config.talker_config.text_config.initializer_range)
        for layer in model.talker.model.layers:
            for param in layer.mlp.experts.parameters():
                param.normal_(0.0, std, generator=gen)
    head = model.thinker.lm_head.weight
    with torch.no_grad():
        # Wide logits keep greedy decoding from repeating one token (as in the text preset).
        head.normal_(0.0, 0.2, generator=torch.Generator(device=head.device).manual_seed(seed + 3))
    _silence_unprintable(model.thinker, tokenizer)
    with torch.no_grad():
        # No placeholders, TTS controls or role markup in random text.
        head[[ids[t] for t in EXTRA_TOKENS]] = 0.0
        head[len(tokenizer) :] = 0.0  # the real vocabulary is wider than the local tokenizer's
        # A random stop head would end speech after a few codes: a zero row sits mid-ranking, where top-k
        # sampling rarely reaches, so utterances run to the cap.
        model.talker.codec_head.weight[config.talker_config.codec_eos_token_id] = 0.0
    _make_audible(model, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    mel_bins = int(config.thinker_config.audio_config.num_mel_bins)
    processor = preprocessor_config(
        mel_bins, "Qwen3OmniMoeProcessor", patch_size=int(config.thinker_config.vision_config.patch_size)
    )
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")
    generation = REAL_GENERATION if real else TINY_GENERATION
    (out / OMNI_GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    (out / "README.md").write_text(
        f"Random-weight Qwen3OmniMoeForConditionalGeneration ({size}) built by `omnimodel make-tiny --preset "
        f"{PRESET}` (seed {seed}); voices {', '.join(VOICES)}. Not a trained model: its text and audio are noise.\n"
    )
    (out / "omnimodel-build.json").write_text(json.dumps({"preset": PRESET, "seed": seed, "size": size}) + "\n")
