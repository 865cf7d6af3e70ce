"""A tiny random-weight Qwen2.5-Omni with the token geometry vLLM-Omni hard-codes.

vLLM-Omni (0.30) runs Qwen2.5-Omni's thinker, talker and code2wav as three engines and refers to real
token ids in code rather than through the config: the speaker "bos" rows 151870 (Ethan) / 151872
(Chelsie) it looks up in the thinker's embedding, the codec controls 8292 (pad) / 8293 (start) / 8294
(end, the talker's stop id) it builds talker prompts from and strips before code2wav, and codec ids
``< 8292`` it forwards to the DiT. So unlike the ``qwen2.5-omni`` preset (a compact vocabulary) this one
keeps the released geometry: thinker vocabulary 151936 with the tokenizer's special tokens at their
released ids (padding rows below them), talker vocabulary 8448 with the released control ids, a DiT
codec table covering every id the talker may emit, ``spk_dict.pt`` keyed by the released voice names,
and a processor config (WhisperFeatureExtractor, Qwen2-VL image and video processors) so vLLM's
multimodal profiling finds one. Attention heads are 32 wide (vLLM's CPU attention rejects 16).

Random-weight traps handled as in the ``qwen2.5-omni`` preset: BigVGAN's convolutions are
re-initialised to an audible level; the thinker's output rows of every token but the trained text
vocabulary are zeroed (no fragments, markup, placeholders or padding tokens in its text); the talker's
rows of every control id (end of speech included) are zeroed, so its top-k sampling never stops on its
own and an utterance is as long as the talker's ``max_tokens`` — tests must cap it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5OmniConfig,
    Qwen2_5OmniForConditionalGeneration,
)
from transformers.utils import logging as hf_logging

from omnimodel_runtime.layout import OMNI_SPEAKER_FILE as SPEAKER_FILE
from omnimodel_runtime.tiny.omni import CHAT_TEMPLATE, NAMED_TOKENS, _make_audible, preprocessor_config
from omnimodel_runtime.tiny.text import ENDOFTEXT, IM_END, IM_START, _silence_unprintable, build_tokenizer

PRESET: Final = "qwen2.5-omni-vllm-omni"

# The released tokenizer's special tokens, by id (Qwen2.5-Omni's tokenizer_config.json).
SPECIAL_IDS: Final[dict[str, int]] = {
    ENDOFTEXT: 151643,
    IM_START: 151644,
    IM_END: 151645,
    "<|AUDIO|>": 151646,
    "<|audio_bos|>": 151647,
    "<|audio_eos|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_bos|>": 151652,
    "<|vision_eos|>": 151653,
    "<|vision_pad|>": 151654,
    "<|IMAGE|>": 151655,
    "<|VIDEO|>": 151656,
}
THINKER_VOCAB: Final = 151936
# Thinker-vocabulary ids past the tokenizer that the talker's prompt is built from.
TTS_TEXT_PAD, TTS_TEXT_BOS, TTS_TEXT_EOD = 151859, 151860, 151861
SPEAKER_BOS: Final[dict[str, int]] = {"Ethan": 151870, "Chelsie": 151872}
# Talker (codec) vocabulary and its control ids, as released and as vLLM-Omni hard-codes them.
TALKER_VOCAB: Final = 8448
CODEC_PAD, CODEC_START, CODEC_END, CODEC_MASK = 8292, 8293, 8294, 8296
USER_TOKEN_ID: Final = 872  # the released config's value; only get_rope_index reads it

THINKER_HIDDEN: Final = 64
HEAD_DIM: Final = 32  # vLLM's CPU attention supports 32 and up
N_MELS: Final = 16  # tiny audio encoder; the feature extractor must agree


def tokenizer_at_ids(
    seed: int,
    special_ids: Mapping[str, int],
    named_tokens: Mapping[str, str],
    chat_template: str,
    pinned: Mapping[str, int] | None = None,
) -> tuple[PreTrainedTokenizerFast, list[int]]:
    """The text preset's byte-level BPE, re-laid so its special tokens sit at ``special_ids`` and the
    trained text tokens named in ``pinned`` at theirs (each swaps places with the entry there).

    Returns the tokenizer and the ids of its trained (text) tokens: ``0..n-1`` but for pinned swaps. The
    other ids below the first special token are unreachable padding entries (no merge produces them), so
    the vocabulary is dense as vLLM expects and every id below the specials decodes. ``named_tokens`` are
    the tokenizer attributes the Omni processors read their placeholders from."""
    trained = build_tokenizer(seed)
    state = json.loads(trained.backend_tokenizer.to_str())
    # Re-number densely: the trainer put the specials first.
    order = sorted((tok for tok in state["model"]["vocab"] if tok not in special_ids), key=state["model"]["vocab"].get)
    n_text = len(order)
    order += [f"<|pad_{i}|>" for i in range(n_text, min(special_ids.values()))]
    for name, want in (pinned or {}).items():
        have = order.index(name)
        order[have], order[want] = order[want], order[have]
    merges: list[tuple[str, str]] = []
    for merge in state["model"]["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(order)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for name, want in sorted(special_ids.items(), key=lambda kv: kv[1]):
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        got = tok.token_to_id(name)
        if got != want:
            raise RuntimeError(f"special token {name} landed at id {got}, not {want}")
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        model_max_length=32768,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        extra_special_tokens=dict(named_tokens),
    )
    wrapped.chat_template = chat_template
    return wrapped, [i for i, t in enumerate(order) if not t.startswith("<|pad_")]


def build_tokenizer_at_released_ids(seed: int) -> tuple[PreTrainedTokenizerFast, int]:
    """Qwen2.5-Omni's special tokens at their released ids (:func:`tokenizer_at_ids`); the tokenizer and
    the number of trained (text) tokens, which keep ids ``0..n-1``."""
    tokenizer, text_ids = tokenizer_at_ids(seed, SPECIAL_IDS, NAMED_TOKENS, CHAT_TEMPLATE)
    return tokenizer, len(text_ids)


def _config() -> Qwen2_5OmniConfig:
    h = THINKER_HIDDEN
    ids = SPECIAL_IDS
    placeholders = {
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
    }
    text = {
        "vocab_size": THINKER_VOCAB,
        "hidden_size": h,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": h // HEAD_DIM,
        "num_key_value_heads": 1,
        # head_dim 32 → the M-RoPE sections sum to 16.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        "max_position_embeddings": 32768,
        "initializer_range": 0.2,
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "bos_token_id": ids[ENDOFTEXT],
        "tie_word_embeddings": False,
    }
    thinker = {
        "text_config": text,
        "audio_config": {
            "num_mel_bins": N_MELS,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 2 * HEAD_DIM,
            "output_dim": h,
            "max_source_positions": 1500,
            "n_window": 100,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 2 * HEAD_DIM,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": h,
            "fullatt_block_indexes": [0],
        },
        "user_token_id": USER_TOKEN_ID,
        **placeholders,
    }
    talker = {
        "vocab_size": TALKER_VOCAB,
        "embedding_size": h,
        "hidden_size": 2 * HEAD_DIM,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        "max_position_embeddings": 32768,
        "initializer_range": 0.2,
        "tts_text_start_token_id": TTS_TEXT_BOS,
        "tts_text_end_token_id": TTS_TEXT_EOD,
        "tts_text_pad_token_id": TTS_TEXT_PAD,
        "tts_codec_pad_token_id": CODEC_PAD,
        "tts_codec_start_token_id": CODEC_START,
        "tts_codec_end_token_id": CODEC_END,
        "tts_codec_mask_token_id": CODEC_MASK,
        **placeholders,
    }
    dit = {
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 1,
        "head_dim": 32,
        "ff_mult": 2,
        "emb_dim": 16,
        "block_size": 24,
        "look_ahead_layers": [1],
        "look_backward_layers": [0, 3],
        # The released table has 8193 rows; vLLM-Omni forwards every id below 8292 to it, which a random
        # talker does emit, so the tiny table covers the whole talker vocabulary.
        "num_embeds": TALKER_VOCAB,
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
        enable_audio_output=True,
    )


def _speakers(config: Qwen2_5OmniConfig, seed: int) -> dict[str, dict[str, Any]]:
    """``spk_dict.pt`` as released: ``{bos_token, cond, ref_mel}`` under the voice names."""
    dit = config.token2wav_config.dit_config
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        voice: {
            "bos_token": bos,
            "cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
            "ref_mel": torch.randn(1, 60, dit.mel_dim, generator=gen),
        }
        for voice, bos in SPEAKER_BOS.items()
    }


def build(out: Path, *, seed: int, size: str = "tiny", device: str = "cpu") -> None:
    """Write the checkpoint (``thinker.*``, ``talker.*``, ``token2wav.*``), speakers, tokenizer, processor."""
    if size != "tiny":
        raise ValueError(f"unknown size {size!r} for preset {PRESET} (known: tiny)")
    hf_logging.disable_progress_bar()
    tokenizer, n_text = build_tokenizer_at_released_ids(seed)
    config = _config()
    torch.manual_seed(seed)  # module initialisers draw from the global RNG
    with torch.device(device):
        model = Qwen2_5OmniForConditionalGeneration(config).eval()
    speakers = _speakers(config, seed)
    with torch.no_grad():
        model.thinker.lm_head.weight.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed + 3))
        # Only trained text tokens (and end of turn) may be said: never padding, markup or placeholders.
        model.thinker.lm_head.weight[n_text:] = 0.0
    _silence_unprintable(model.thinker, tokenizer)
    with torch.no_grad():
        end_of_turn = model.thinker.lm_head.weight[SPECIAL_IDS[IM_END]]
        end_of_turn.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed + 4))
        # Control ids (pad/start/end/mask and the unused tail) in the middle of the ranking: top-k
        # sampling never reaches them, so speech runs to max_tokens and every code is a real codec id.
        model.talker.codec_head.weight[CODEC_PAD:] = 0.0
    _make_audible(model, speakers["Chelsie"], seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(N_MELS), indent=2, sort_keys=True) + "\n"
    )
    torch.save(speakers, out / SPEAKER_FILE)
    (out / "README.md").write_text(
        "Random-weight Qwen2_5OmniForConditionalGeneration (tiny) with the token geometry vLLM-Omni "
        f"expects, built by `omnimodel make-tiny --preset {PRESET}` (seed {seed}); voices "
        f"{', '.join(SPEAKER_BOS)}. Not a trained model: its text and audio are noise.\n"
    )
    (out / "omnimodel-build.json").write_text(json.dumps({"preset": PRESET, "seed": seed, "size": size}) + "\n")
