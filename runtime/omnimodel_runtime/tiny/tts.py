"""The tiny model of the ``tts`` preset: random-weight SpeechT5 (text -> mel) and HiFi-GAN (mel -> audio).

Layout of a ``tts`` model directory (the same for real weights, see docs/pipelines/tts.md)::

    acoustic/   SpeechT5ForTextToSpeech + its SpeechT5Tokenizer (sentencepiece character model)
    vocoder/    SpeechT5HifiGan
    voices/     <name>.npy, one float32 speaker embedding per voice (``default`` is always served)
    speech.json generation bounds for the acoustic stage (threshold, minlenratio, maxlenratio)

What makes a random model usable in tests (docs/reference/PIPELINE-NOTES.md, two-stage TTS):

- The tokenizer is a sentencepiece *character* model trained here on generated text, with SpeechT5's
  special-token ids (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3), wrapped by ``SpeechT5Tokenizer``.
- A random stop head stops at an arbitrary step; its bias is pushed far negative so generation always
  runs to ``maxlenratio`` (written to ``speech.json``), which makes the duration proportional to the
  text: ``maxlenratio / reduction_factor`` decoder steps of ``reduction_factor`` frames each, i.e. 4 mel
  frames (64 ms at 16 kHz, hop 256) per token.
- HiFi-GAN's default initialisation gives near-silence (~1e-8); its convolutions are re-initialised and
  the last one scaled so the output sits well inside [-1, 1] at an audible level.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from transformers import (
    SpeechT5Config,
    SpeechT5ForTextToSpeech,
    SpeechT5HifiGan,
    SpeechT5HifiGanConfig,
    SpeechT5Tokenizer,
)
from transformers.utils import logging as hf_logging

from omnimodel_runtime.layout import ACOUSTIC_DIR, SPEECH_CONFIG, VOCODER_DIR, VOICES_DIR

SPM_FILE: Final = "spm_char.model"

# Named voices shipped with the tiny model; ``default`` must exist.
VOICES: Final = ("default", "alto", "bass")

# Generation bounds: the random stop head never fires, so every utterance runs to maxlen.
GENERATION: Final = {"threshold": 0.5, "minlenratio": 0.0, "maxlenratio": 4.0}

_WORD_TEXT: Final = (
    "the a of to and in is it that for on with as was at by be this from or have not are but model stage "
    "engine token text image audio speech voice gateway pipeline request answer hello world tiny random "
    "weight stream cluster operator node quick brown fox jumps over lazy dog sing say speak listen loud "
    "quiet morning evening zero one two three four five six seven eight nine ten"
)
_PUNCT: Final = (".", ",", "?", "!", ":", ";", "'", '"', "-", "(", ")")

SIZES: Final[dict[str, dict[str, Any]]] = {
    # What tests and the demo run: a few milliseconds per decoder step on one CPU core.
    "tiny": {
        "acoustic": {
            "hidden_size": 64,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "decoder_layers": 2,
            "decoder_attention_heads": 2,
            "decoder_ffn_dim": 128,
            "speech_decoder_prenet_units": 64,
            "speech_decoder_postnet_units": 64,
            "speaker_embedding_dim": 64,
            "max_text_positions": 600,
            "max_speech_positions": 4000,
        },
        "vocoder": {"upsample_initial_channel": 32},
    },
    # microsoft/speecht5_tts + speecht5_hifigan shapes: random weights cost the same compute as trained
    # ones, so benchmarks at this size measure the real per-step cost.
    "speecht5": {"acoustic": {}, "vocoder": {}},
}


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """Deterministic pseudo-English with both cases, digits and punctuation (every character the
    tokenizer should know appears many times)."""
    rng = random.Random(seed)  # noqa: S311  (reproducible filler text, not secrets)
    pool = _WORD_TEXT.split()
    out: list[str] = []
    for _ in range(lines):
        words = [rng.choice(pool) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.4:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        if rng.random() < 0.3:
            words = [w.upper() if rng.random() < 0.5 else w.capitalize() for w in words]
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(_PUNCT))
    # Every ASCII letter in both cases, so none of them falls back to <unk>.
    out.append("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789")
    return out


def build_tokenizer(out: Path, seed: int) -> SpeechT5Tokenizer:
    """Train a sentencepiece character model into ``out`` and wrap it as SpeechT5's tokenizer."""
    import sentencepiece as spm  # noqa: PLC0415  (only the tiny builder trains tokenizers)

    out.mkdir(parents=True, exist_ok=True)
    corpus = _corpus(seed)
    model = io.BytesIO()
    # Written through model_writer: with model_prefix the file would embed its (temporary) path, and
    # two builds with the same seed would differ.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        model_type="char",
        # A char model's vocabulary: every distinct character (space becomes U+2581) + 4 special pieces.
        vocab_size=len(set("".join(corpus))) + 4,
        character_coverage=1.0,
        bos_id=0,
        pad_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
        num_threads=1,
    )
    (out / SPM_FILE).write_bytes(model.getvalue())
    return SpeechT5Tokenizer(vocab_file=str(out / SPM_FILE))


def _reinit_vocoder(vocoder: SpeechT5HifiGan, seed: int) -> None:
    """Replace HiFi-GAN's near-silent default initialisation with one that makes audible noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in vocoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                fan_in = module.weight.shape[1] * module.weight.shape[2]
                if isinstance(module, torch.nn.ConvTranspose1d):
                    fan_in = module.weight.shape[0] * module.weight.shape[2] // max(1, module.stride[0])
                std = (1.0 / max(1, fan_in)) ** 0.5
                module.weight.normal_(0.0, std, generator=gen)
                if module.bias is not None:
                    module.bias.zero_()
        # Scale the last layer so a typical mel gives a waveform RMS around 0.2 (tanh keeps it in [-1, 1]).
        probe = torch.randn(1, 50, vocoder.config.model_in_dim, generator=gen)
        rms = float(vocoder(probe).pow(2).mean().sqrt())
        if rms > 0:
            vocoder.conv_post.weight.mul_(0.2 / rms)


def build(out: Path, *, seed: int, size: str = "tiny") -> None:
    """Write a random-weight two-stage TTS model directory (layout in the module docstring)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for preset tts (known: {', '.join(SIZES)})")
    hf_logging.disable_progress_bar()
    arch = SIZES[size]
    tokenizer = build_tokenizer(out / ACOUSTIC_DIR, seed)

    torch.manual_seed(seed)
    config = SpeechT5Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        **arch["acoustic"],
    )
    acoustic = SpeechT5ForTextToSpeech(config).eval()
    with torch.no_grad():
        # Never stop early: duration = maxlenratio frames-per-token (see module docstring).
        acoustic.speech_decoder_postnet.prob_out.weight.zero_()
        acoustic.speech_decoder_postnet.prob_out.bias.fill_(-20.0)
    acoustic.save_pretrained(out / ACOUSTIC_DIR)
    tokenizer.save_pretrained(out / ACOUSTIC_DIR)

    vocoder = SpeechT5HifiGan(SpeechT5HifiGanConfig(**arch["vocoder"])).eval()
    _reinit_vocoder(vocoder, seed)
    vocoder.save_pretrained(out / VOCODER_DIR)

    voices = out / VOICES_DIR
    voices.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in VOICES:
        np.save(voices / f"{name}.npy", rng.standard_normal(config.speaker_embedding_dim).astype(np.float32))

    (out / SPEECH_CONFIG).write_text(json.dumps(GENERATION, indent=2) + "\n")
    (out / "README.md").write_text(
        f"Random-weight SpeechT5 + HiFi-GAN ({size}) built by `omnimodel make-tiny --preset tts` (seed {seed}). "
        "Not a trained model: it speaks noise.\n"
    )
    (out / "omnimodel-build.json").write_text(json.dumps({"preset": "tts", "seed": seed, "size": size}) + "\n")
