"""The Qwen3-Omni stage engines, one module per stage: MoE thinker -> talker (with its code predictor) -> code2wav.

They follow the body of ``Qwen3OmniMoeForConditionalGeneration.generate()`` (transformers), on the Qwen2.5-Omni
engines' mechanism (:class:`~omnimodel_runtime.engines.omni.engine.OmniEngine`: a worker thread fed the
upstream frames, cancellation checked at every step), one request at a time or, with ``engine_args.batching``
(the default on accelerators), batched as Qwen2.5-Omni's stages are (:mod:`.slots`: decode steps of every
running request over per-request KV cache slots, with Qwen3's query/key norms):

- **thinker** (:class:`Qwen3ThinkerEngine`): the Qwen2.5-Omni thinker engine (chat template, sampling, stop
  strings, forced replies, voices, audio, image and video input through ``Qwen3OmniMoeProcessor``) on
  ``Qwen3OmniMoeThinkerForConditionalGeneration``. The talker reads the thinker's *input embeddings* of text
  positions (its ``text_projection`` of them) and, at audio/image/video placeholders of the prompt, the hidden
  states of layer ``accept_hidden_layer`` (its ``hidden_projection``), so the row hook streams those: every
  prompt position after the prefill (a forward hook on that decoder layer keeps the prefill's output), then
  one embedding row per consumed reply token. Batched, text requests decode together in slots (a request
  with media runs whole through ``generate()`` beside them, as in Qwen2.5-Omni's thinker).
- **talker** (:class:`Qwen3TalkerEngine`): builds the whole model's talker inputs (user turns and the
  assistant's first tokens projected, the ``trailing_text_hidden`` of the rest of the reply, ``tts_pad``, the
  media's feature lengths, patch grids and a video's seconds per temporal patch for its M-RoPE) and runs
  ``Qwen3OmniMoeTalkerForConditionalGeneration.generate()``: each step samples a first-group code, and the
  next step's code predictor draws its residual codes; one frame of ``num_code_groups`` codes goes to code2wav
  per step. One request at a time it starts when the thinker has finished: the whole model projects the
  assistant's text in one batch, and projecting rows as they arrive rounds differently (measured on CPU: rows
  of fewer than four), so waiting is what keeps the split equal to the whole model. Batched
  (:mod:`.batched_talker`) it starts on the thinker's first reply row and steps every request together, the
  code predictor's residual codes of all of them in one batch.
- **code2wav** (:class:`Qwen3Code2WavEngine`): ``Qwen3OmniMoeCode2Wav`` (codes -> 24 kHz waveform, no
  randomness). Whole path (non-streamed requests): ``chunked_decode(codes, 300, 25)`` as the whole model;
  streamed: chunks of ``stream_chunk`` codes as they arrive, each with ``left_context`` codes before it and
  one after, joined without gaps (within 1 LSB of one pass; see :data:`STREAM_CHUNK`). Batched, the ready
  chunks of several streams with windows of one length run as one pass.

Video input is Qwen2.5-Omni's (:mod:`.video`, :mod:`.inputs`): the same video processor class, with
Qwen3's sizes and time positions from its processor. Frame layouts: docs/pipelines/qwen3-omni.md.
"""

from omnimodel_runtime.engines.omni.qwen3.code2wav import Qwen3Code2WavEngine
from omnimodel_runtime.engines.omni.qwen3.common import lend_audio_config
from omnimodel_runtime.engines.omni.qwen3.talker import Qwen3TalkerEngine
from omnimodel_runtime.engines.omni.qwen3.thinker import Qwen3ThinkerEngine

__all__ = ["Qwen3Code2WavEngine", "Qwen3TalkerEngine", "Qwen3ThinkerEngine", "lend_audio_config"]
