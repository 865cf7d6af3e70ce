"""The tiny model of the ``text`` preset: a random-weight ``Qwen2ForCausalLM`` with a local tokenizer.

Sizes follow what both engines need on CPU: vLLM's CPU attention wants ``head_dim >= 64``, so the model
has 2 query heads of 64 (hidden 128) sharing one key/value head. ``initializer_range=0.2`` spreads the
logits enough that greedy decoding does not repeat one token forever. The byte-level BPE tokenizer is
trained here on a generated corpus, so nothing is downloaded; its special tokens and chat template are
the ChatML ones Qwen uses.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Final

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

ENDOFTEXT: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
SPECIAL_TOKENS: Final = (ENDOFTEXT, IM_START, IM_END)
VOCAB_SIZE: Final = 1024

# ChatML as in Qwen2's tokenizer_config, trimmed to what a text-only model needs. Content may be a string
# or a list of OpenAI content parts; only text parts are rendered.
CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Vocabulary of the generated corpus (split at use).
_WORD_TEXT: Final = (
    "the a an of to and in is it that for on with as was at by be this from or have not are "
    "but model stage engine token text image audio speech gateway pipeline request answer "
    "question hello world tiny random weight batch stream cluster operator kube pod node "
    "service deploy one two three four five six seven eight nine ten red green blue fast slow "
    "small large what why how when where who which can will would should could may might must "
    "shall run walk talk think write read speak listen see look find make take give keep let "
    "day night time year way thing man woman child life hand part place case week point good "
    "new first last long great little own other old right big high different next early "
)
_PUNCT: Final = (".", ",", "?", "!", ":", ";")


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English (plus digits, punctuation and ChatML turns) to train BPE on."""
    rng = random.Random(seed)  # noqa: S311  (reproducible filler text, not secrets)
    words_pool = _WORD_TEXT.split()
    out: list[str] = []
    for i in range(lines):
        words = [rng.choice(words_pool) for _ in range(rng.randint(3, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(_PUNCT)
        if i % 5 == 0:
            role = rng.choice(("system", "user", "assistant"))
            sentence = f"{IM_START}{role}\n{sentence}{IM_END}\n"
        out.append(sentence)
    return out


def byte_level_bpe(
    corpus: list[str],
    *,
    vocab_size: int,
    special_tokens: tuple[str, ...],
    eos_token: str,
    pad_token: str,
    model_max_length: int,
    padding_side: str,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``corpus`` (every byte encodable), as Qwen's are built."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        unk_token=None,
        model_max_length=model_max_length,
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """Qwen's special tokens and chat template on a locally trained byte-level BPE."""
    wrapped = byte_level_bpe(
        _corpus(seed),
        vocab_size=VOCAB_SIZE,
        special_tokens=tuple(SPECIAL_TOKENS),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=4096,
        padding_side="left",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """The byte -> character table of byte-level BPE (GPT-2's, which ``tokenizers`` ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _silence_unprintable(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Zero the output rows of tokens a reader should not see a random model emit.

    Lone bytes 0x80-0xFF are fragments of UTF-8 sequences, so a random model emitting them prints
    replacement characters; control bytes (other than newline) garble terminals; ``<|im_start|>`` and
    ``<|endoftext|>`` would print markup. A zero row gives a logit of exactly 0 while the best of ~1000
    random logits is well above it, so greedy decoding never picks these (sampling rarely does). The
    input embeddings (untied) stay random.
    """
    vocab = tokenizer.get_vocab()
    byte_to_char = _gpt2_bytes_to_unicode()
    unprintable = [b for b in range(256) if b >= 0x7F or (b < 0x20 and b != 0x0A)]
    rows = [vocab[byte_to_char[b]] for b in unprintable if byte_to_char[b] in vocab]
    rows += [vocab[ENDOFTEXT], vocab[IM_START]]
    with torch.no_grad():
        model.lm_head.weight[rows] = 0.0


# Architectures by size. "tiny" is what tests and the demo run; the real sizes (Qwen2.5's published
# configurations) let benchmarks on accelerators measure real per-token compute with random weights,
# which cost the same as trained ones (DESIGN section 8). Real sizes keep the real vocabulary width;
# rows past the local tokenizer's ids are silenced like the unprintable ones.
SIZES: Final[dict[str, dict[str, Any]]] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "initializer_range": 0.2,
        "dtype": "float32",
    },
    "qwen2.5-1.5b": {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "dtype": "bfloat16",
    },
}


def build(out: Path, *, seed: int, size: str = "tiny", device: str = "cpu") -> None:
    """Write a random-weight ``Qwen2ForCausalLM`` checkpoint (``size`` from :data:`SIZES`) with its
    tokenizer into ``out``. ``device`` only speeds up initialising the large sizes."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for preset text (known: {', '.join(SIZES)})")
    # A progress bar per saved shard is noise in build logs.
    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer(seed)
    endoftext = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    arch = dict(SIZES[size])
    vocab_size = int(arch.pop("vocab_size", len(tokenizer)))
    config = Qwen2Config(
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        architectures=["Qwen2ForCausalLM"],
        **arch,
    )
    # Seed the global RNG: module initialisers draw from it, and the same seed must give the same bytes.
    torch.manual_seed(seed)
    dtype = getattr(torch, arch["dtype"])
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    _silence_unprintable(model, tokenizer)
    if vocab_size > len(tokenizer):
        with torch.no_grad():
            model.lm_head.weight[len(tokenizer) :] = 0.0
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext,
        eos_token_id=[im_end, endoftext],
        pad_token_id=endoftext,
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(
        f"Random-weight Qwen2ForCausalLM ({size}) built by `omnimodel make-tiny --preset text` "
        f"(seed {seed}). Not a trained model: its output is noise.\n"
    )
    (out / "omnimodel-build.json").write_text(json.dumps({"preset": "text", "seed": seed, "size": size}) + "\n")
