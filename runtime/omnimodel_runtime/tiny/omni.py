"""The tiny model of the ``qwen2.5-omni`` preset: a random-weight ``Qwen2_5OmniForConditionalGeneration``.

One full checkpoint, laid out like the released one (``thinker.*``, ``talker.*``, ``token2wav.*`` weights in
``model.safetensors``, ``spk_dict.pt``, tokenizer, the released chat template and ``preprocessor_config.json``
for the audio feature extractor and image processor), so the stage engines load their part
from it exactly as they load the real model. Sizes honour the architecture's constraints
(``sum(mrope_section) == head_dim / 2`` for thinker text and talker, ``talker.embedding_size`` and the
encoders' output width equal to the thinker's hidden size, ``dit.num_embeds >= talker vocab``) and keep the
real vocoder geometry (mel 80, upsampling 5·3·2·2·2·2 = 240 samples per mel frame, DiT blocks of 24 frames),
so chunking and receptive-field arithmetic is the real one.

``size="qwen2.5-omni-7b"`` is Qwen2.5-Omni-7B's architecture (thinker 3584 × 28 layers, audio and vision
towers 32 × 1280, talker 896 × 24 layers, DiT 1024 × 22 layers, BigVGAN 1536 channels; 10.7 B parameters,
bfloat16) with random weights, for measuring real per-token compute on an accelerator; ``device="cuda"``
initialises it there (seconds instead of many minutes on a CPU) and writes it from there.

Two traps of random weights are handled here: HF's default init makes BigVGAN output silence (~1e-8), so
its convolutions are re-initialised and the output layer scaled to an audible level; and the thinker would
print byte fragments and markup, so those rows of its output head are zeroed as in the text preset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import torch
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5OmniConfig,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2VLImageProcessor,
    WhisperFeatureExtractor,
)
from transformers.utils import logging as hf_logging

from omnimodel_runtime.layout import OMNI_GENERATION_FILE, OMNI_SPEAKER_FILE
from omnimodel_runtime.tiny.text import ENDOFTEXT, IM_END, _silence_unprintable, build_tokenizer

# Placeholder and TTS control tokens the architecture refers to by id (all thinker-vocabulary ids), and
# one "speaker bos" token per voice (the released model keeps them in spk_dict.pt as ``bos_token``).
AUDIO, IMAGE, VIDEO = "<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>"
AUDIO_BOS, AUDIO_EOS, VISION_BOS, VISION_EOS = "<|audio_bos|>", "<|audio_eos|>", "<|vision_bos|>", "<|vision_eos|>"
TTS_PAD, TTS_TEXT_BOS, TTS_TEXT_EOD = "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"
VOICES: Final = ("Chelsie", "Ethan")
# The media markers and TTS controls, after the three placeholders (the Qwen3-Omni tiny model's too).
MARKERS: Final = (AUDIO_BOS, AUDIO_EOS, VISION_BOS, VISION_EOS, TTS_PAD, TTS_TEXT_BOS, TTS_TEXT_EOD)
EXTRA_TOKENS: Final = (AUDIO, IMAGE, VIDEO, *MARKERS, *(f"<|spk_{v.lower()}|>" for v in VOICES))


def named_tokens(audio: str, image: str, video: str) -> dict[str, str]:
    """The tokenizer attributes the released tokenizer_config names (the Omni processors look them up by
    name), for these placeholders."""
    return {
        "audio_token": audio,
        "audio_bos_token": AUDIO_BOS,
        "audio_eos_token": AUDIO_EOS,
        "image_token": image,
        "video_token": video,
        "vision_bos_token": VISION_BOS,
        "vision_eos_token": VISION_EOS,
    }


def chat_template(audio: str, image: str, video: str) -> str:
    """Qwen2.5-Omni's chat template (the released one, without its default system prompt) for these
    placeholders: audio, image and video parts become their placeholder between markers, which the
    processor expands to one token per encoder output."""
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for content in message['content'] %}"
        "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
        f"{{{{- '{VISION_BOS}{image}{VISION_EOS}' }}}}"
        "{%- elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
        f"{{{{- '{AUDIO_BOS}{audio}{AUDIO_EOS}' }}}}"
        "{%- elif content['type'] == 'video' or 'video' in content %}"
        f"{{{{- '{VISION_BOS}{video}{VISION_EOS}' }}}}"
        "{%- elif content['type'] == 'text' %}{{- content['text'] }}"
        "{%- endif %}{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


NAMED_TOKENS: Final = named_tokens(AUDIO, IMAGE, VIDEO)
CHAT_TEMPLATE: Final = chat_template(AUDIO, IMAGE, VIDEO)

THINKER_HIDDEN: Final = 64
# Mel bins of the tiny audio encoder; its feature extractor must agree.
N_MELS: Final = 16
CODEC_TOKENS: Final = 64  # real codec ids 0..63; the four control ids follow
# Target RMS of the tiny vocoder's output: clearly audible, far from clipping.
TARGET_RMS: Final = 0.1
# Default stage parameters written next to the weights (engine_args still override them). The tiny talker
# rarely samples end-of-speech (see build), so its audio is capped at 64 codes (1.28 s).
TINY_GENERATION: Final[dict[str, Any]] = {"talker": {"max_new_tokens": 64}}


# The released model's codec vocabulary: ids 0..8191 are codes, then pad 8292, start 8293, end 8294, mask 8296.
REAL_CODES: Final = 8192
# Stage defaults of the real-size build: 575 codes = 11.5 s of speech per answer (the random talker never
# ends speech on its own; see build).
REAL_GENERATION: Final[dict[str, Any]] = {"talker": {"max_new_tokens": 575}}
SIZES: Final = ("tiny", "qwen2.5-omni-7b")


def _real_config(ids: dict[str, int], eos: int, pad: int) -> Qwen2_5OmniConfig:
    """Qwen2.5-Omni-7B's sizes (its config.json), with this tokenizer's token ids."""
    text = {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "bos_token_id": pad,
        "tie_word_embeddings": False,
    }
    placeholders = {
        "audio_token_index": ids[AUDIO],
        "image_token_index": ids[IMAGE],
        "video_token_index": ids[VIDEO],
        "audio_start_token_id": ids[AUDIO_BOS],
        "audio_end_token_id": ids[AUDIO_EOS],
        "vision_start_token_id": ids[VISION_BOS],
        "vision_end_token_id": ids[VISION_EOS],
    }
    thinker = {
        "text_config": text,
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 32,
            "encoder_attention_heads": 20,
            "encoder_ffn_dim": 5120,
            "d_model": 1280,
            "output_dim": 3584,
            "max_source_positions": 1500,
            "n_window": 100,
        },
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 3584,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
        **placeholders,
        "user_token_id": ids[AUDIO],
    }
    talker = {
        "vocab_size": 8448,
        "embedding_size": 3584,
        "hidden_size": 896,
        "intermediate_size": 18944,
        "num_hidden_layers": 24,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "tts_text_start_token_id": ids[TTS_TEXT_BOS],
        "tts_text_end_token_id": ids[TTS_TEXT_EOD],
        "tts_text_pad_token_id": ids[TTS_PAD],
        "tts_codec_pad_token_id": 8292,
        "tts_codec_start_token_id": 8293,
        "tts_codec_end_token_id": 8294,
        "tts_codec_mask_token_id": 8296,
        **placeholders,
    }
    dit = {
        "hidden_size": 1024,
        "num_hidden_layers": 22,
        "num_attention_heads": 16,
        "head_dim": 64,
        "ff_mult": 2,
        "emb_dim": 512,
        "block_size": 24,
        "look_ahead_layers": [10],
        "look_backward_layers": [0, 20],
        # Every id a random talker can sample (its whole vocabulary) must have a code embedding.
        "num_embeds": 8448,
        "mel_dim": 80,
        "repeats": 2,
        "enc_emb_dim": 192,
        "enc_dim": 128,
        "enc_channels": [256, 256, 256, 256, 768],
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_attention_channels": 64,
        "enc_res2net_scale": 2,
        "enc_se_channels": 64,
    }
    bigvgan = {"mel_dim": 80, "upsample_initial_channel": 1536}
    return Qwen2_5OmniConfig(
        thinker_config=thinker,
        talker_config=talker,
        token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
    )


def _config(ids: dict[str, int], vocab: int, eos: int, pad: int) -> Qwen2_5OmniConfig:
    h = THINKER_HIDDEN
    text = {
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        # head_dim 32 → M-RoPE sections must sum to 16.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        "max_position_embeddings": 4096,
        # Wide logits keep greedy decoding from repeating one token forever (as in the text preset).
        "initializer_range": 0.2,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "bos_token_id": pad,
        "tie_word_embeddings": False,
    }
    thinker = {
        "text_config": text,
        "audio_config": {
            "num_mel_bins": N_MELS,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "d_model": 16,
            "output_dim": h,
            "max_source_positions": 100,
            "n_window": 10,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": h,
            "fullatt_block_indexes": [0],
        },
        "audio_token_index": ids[AUDIO],
        "image_token_index": ids[IMAGE],
        "video_token_index": ids[VIDEO],
        "audio_start_token_id": ids[AUDIO_BOS],
        "audio_end_token_id": ids[AUDIO_EOS],
        # get_rope_index reads these from the thinker config although the class does not declare them.
        "vision_start_token_id": ids[VISION_BOS],
        "vision_end_token_id": ids[VISION_EOS],
        "user_token_id": ids[AUDIO],
    }
    c = CODEC_TOKENS
    talker = {
        "vocab_size": c + 8,
        "embedding_size": h,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        "max_position_embeddings": 4096,
        "initializer_range": 0.2,
        "tts_text_start_token_id": ids[TTS_TEXT_BOS],
        "tts_text_end_token_id": ids[TTS_TEXT_EOD],
        "tts_text_pad_token_id": ids[TTS_PAD],
        # Same relative layout as the released codec vocabulary (pad 8292, start 8293, end 8294, mask 8296).
        "tts_codec_pad_token_id": c,
        "tts_codec_start_token_id": c + 1,
        "tts_codec_end_token_id": c + 2,
        "tts_codec_mask_token_id": c + 4,
        "audio_token_index": ids[AUDIO],
        "image_token_index": ids[IMAGE],
        "video_token_index": ids[VIDEO],
        "audio_start_token_id": ids[AUDIO_BOS],
        "audio_end_token_id": ids[AUDIO_EOS],
        "vision_start_token_id": ids[VISION_BOS],
        "vision_end_token_id": ids[VISION_EOS],
    }
    dit = {
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "head_dim": 16,
        "ff_mult": 2,
        "emb_dim": 16,
        # The released geometry: 24-frame blocks, one look-ahead layer in the middle, look-back at the ends.
        "block_size": 24,
        "look_ahead_layers": [1],
        "look_backward_layers": [0, 3],
        "num_embeds": c + 8,
        "mel_dim": 80,
        "repeats": 2,
        "enc_emb_dim": 16,
        "enc_dim": 16,
        "enc_channels": [16, 16, 16, 16, 48],
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_attention_channels": 8,
        "enc_res2net_scale": 2,
        "enc_se_channels": 8,
    }
    bigvgan = {"mel_dim": 80, "upsample_initial_channel": 64}
    return Qwen2_5OmniConfig(
        thinker_config=thinker,
        talker_config=talker,
        token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
    )


def preprocessor_config(mel_bins: int, processor_class: str = "Qwen2_5OmniProcessor", **image: Any) -> dict[str, Any]:
    """``preprocessor_config.json`` as the released checkpoint has it: the audio feature extractor's and
    the image processor's settings (``image``: those that differ from Qwen2-VL's defaults) in one file,
    ``processor_class`` naming the Omni processor (the video processor takes the image settings). Written
    as data: instantiating the processor needs torchvision, which the project's environment does not
    carry."""
    audio = WhisperFeatureExtractor(feature_size=mel_bins, chunk_length=300, n_samples=4800000, nb_max_frames=30000)
    merged: dict[str, Any] = {**Qwen2VLImageProcessor(**image).to_dict(), **audio.to_dict()}
    merged["processor_class"] = processor_class
    merged["return_attention_mask"] = True  # the thinker's audio encoder reads feature_attention_mask
    return merged


def _tokenizer(
    seed: int, extra: tuple[str, ...] = EXTRA_TOKENS, placeholders: tuple[str, str, str] = (AUDIO, IMAGE, VIDEO)
) -> PreTrainedTokenizerFast:
    """The text preset's tokenizer plus the placeholder, TTS and speaker tokens (``extra``), named as the
    released tokenizer names them (the Omni processors read ``tokenizer.audio_token`` and its kin), with
    the released chat template; ``placeholders``: the audio, image and video placeholder tokens."""
    trained = build_tokenizer(seed)
    trained.add_special_tokens({"additional_special_tokens": list(extra)})
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        model_max_length=trained.model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        extra_special_tokens=named_tokens(*placeholders),
    )
    wrapped.chat_template = chat_template(*placeholders)
    return wrapped


def _speakers(ids: dict[str, int], config: Qwen2_5OmniConfig, seed: int) -> dict[str, dict[str, Any]]:
    """``spk_dict.pt`` entries as the released file has them: ``{bos_token, cond, ref_mel}`` per voice."""
    dit = config.token2wav_config.dit_config
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        voice: {
            "bos_token": ids[f"<|spk_{voice.lower()}|>"],
            "cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
            "ref_mel": torch.randn(1, 60, dit.mel_dim, generator=gen),
        }
        for voice in VOICES
    }


def _make_audible(
    model: Qwen2_5OmniForConditionalGeneration, speaker: dict[str, Any], seed: int, codes: int = CODEC_TOKENS
) -> None:
    """Re-initialise BigVGAN's convolutions, then scale its output layer so a probe utterance has
    :data:`TARGET_RMS`. The signal's level grows steeply with the init scale through the residual blocks,
    so a scale that keeps it small but non-zero is chosen and the last (linear) layer sets the level."""
    vocoder = model.token2wav.code2wav_bigvgan_model
    dit = model.token2wav.code2wav_dit_model
    device = next(vocoder.parameters()).device
    # Draws on the weights' device (a CPU generator cannot fill GPU tensors); the CPU build is unchanged.
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    speaker = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in speaker.items()}
    with torch.no_grad():
        for module in vocoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                fan = module.weight.shape[1] * module.weight.shape[2]
                module.weight.normal_(0.0, 0.66 / fan**0.5, generator=gen)
                if module.bias is not None:
                    module.bias.zero_()
        probe = torch.randint(0, codes, (1, 48), generator=gen, device=device)
        torch.manual_seed(seed)  # the DiT draws its initial noise from the global generator
        mel = dit.sample(speaker["cond"].float(), speaker["ref_mel"].float(), probe)
        rms = float(vocoder(mel).float().pow(2).mean().sqrt())
        if rms == 0.0:
            raise RuntimeError("the tiny vocoder is silent even after re-initialisation")
        vocoder.conv_post.weight.mul_(TARGET_RMS / rms)


def build(out: Path, *, seed: int, size: str = "tiny", device: str = "cpu") -> None:
    """Write a random-weight Qwen2.5-Omni checkpoint (thinker, talker, token2wav, speakers, tokenizer)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for preset qwen2.5-omni (known: {', '.join(SIZES)})")
    real = size != "tiny"
    hf_logging.disable_progress_bar()
    tokenizer = _tokenizer(seed)
    ids = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in EXTRA_TOKENS}
    eos = int(tokenizer.convert_tokens_to_ids(IM_END))
    pad = int(tokenizer.convert_tokens_to_ids(ENDOFTEXT))
    # The talker's codec vocabulary is smaller than the thinker token ids its config holds (as in the
    # released model), which transformers' config validation reports once per field: 14 "unexpected
    # behavior" lines about ids that are right. The engines load the config quietly too.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        config = _real_config(ids, eos, pad) if real else _config(ids, len(tokenizer), eos, pad)
        # Module initialisers draw from the global RNG: the same seed must give the same bytes.
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2_5OmniForConditionalGeneration(config).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    speakers = _speakers(ids, config, seed)
    head = model.thinker.lm_head.weight
    with torch.no_grad():
        # The whole model initialises every part with its top-level std (0.02), whose narrow logits make
        # greedy decoding repeat one token; the text preset's wider head (0.2) reads like varied text.
        head.normal_(0.0, 0.2, generator=torch.Generator(device=head.device).manual_seed(seed + 3))
    _silence_unprintable(model.thinker, tokenizer)
    with torch.no_grad():
        # A random model must not "say" placeholders, TTS controls or speaker tokens either, nor ids past
        # the local tokenizer's (the real vocabulary is wider).
        head[list(ids.values())] = 0.0
        head[len(tokenizer) :] = 0.0
        # A random stop head would end speech after a handful of codes; a zero row puts end-of-speech in
        # the middle of the ranking, where top-p sampling rarely reaches, so utterances run to the cap.
        talker = model.talker
        talker.codec_head.weight[[talker.codec_pad_token, talker.codec_eos_token]] = 0.0
    _make_audible(model, speakers[VOICES[0]], seed, REAL_CODES if real else CODEC_TOKENS)
    if real:
        # As released: bfloat16 weights (the code2wav stage runs token2wav in float32 from them).
        model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    mel_bins = int(config.thinker_config.audio_config.num_mel_bins)
    (out / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(mel_bins), indent=2, sort_keys=True) + "\n"
    )
    torch.save(speakers, out / OMNI_SPEAKER_FILE)
    generation = REAL_GENERATION if real else TINY_GENERATION
    (out / OMNI_GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    (out / "README.md").write_text(
        f"Random-weight Qwen2_5OmniForConditionalGeneration ({size}) built by "
        f"`omnimodel make-tiny --preset qwen2.5-omni` (seed {seed}); voices {', '.join(VOICES)}. "
        "Not a trained model: its text and audio are noise.\n"
    )
    (out / "omnimodel-build.json").write_text(json.dumps({"preset": "qwen2.5-omni", "seed": seed, "size": size}) + "\n")
