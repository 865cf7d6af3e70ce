"""File names inside the model directories the runtime loads, beyond each library's own.

The engines read these and the tiny builders (:mod:`omnimodel_runtime.tiny`) write them, so they live
below both: a builder never imports an engine. Plain constants, no imports.
"""

from __future__ import annotations

from typing import Final

# ---------------------------------------------------------------- the tts preset
# One directory holds each stage's weights in its own subdirectory (a plain ``microsoft/speecht5_tts``
# snapshot, without them, serves as the acoustic stage as it is), the voices and the stopping rule.
ACOUSTIC_DIR: Final = "acoustic"
VOCODER_DIR: Final = "vocoder"
VOICES_DIR: Final = "voices"  # <name>.npy speaker embeddings
SPEECH_CONFIG: Final = "speech.json"  # SpeechT5's generate() bounds: threshold, minlenratio, maxlenratio

# ---------------------------------------------------------------- the qwen2.5-omni preset
# The released checkpoint's speaker map: {name: {bos_token, cond, ref_mel}}.
OMNI_SPEAKER_FILE: Final = "spk_dict.pt"
# Ours: per-part generation parameters ({"talker": {...}, "token2wav": {...}}) the released model
# passes to generate() in code rather than in a file.
OMNI_GENERATION_FILE: Final = "omni_generation_config.json"
