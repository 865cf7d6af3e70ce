"""The Qwen3-Omni thinker stage (:class:`Qwen3ThinkerEngine`): the Qwen2.5-Omni thinker engine on
``Qwen3OmniMoeThinkerForConditionalGeneration``; the talker reads the thinker's input embeddings of text
positions and, at audio/image/video placeholders of the prompt, the hidden states of layer
``accept_hidden_layer``, which the row hook streams."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from transformers import Qwen3OmniMoeProcessor, Qwen3OmniMoeThinkerForConditionalGeneration

from omnimodel_runtime.engines.omni.common import load_part
from omnimodel_runtime.engines.omni.engine import OmniJob
from omnimodel_runtime.engines.omni.inputs import load_processor
from omnimodel_runtime.engines.omni.qwen3.common import load_config, moe_experts, speakers
from omnimodel_runtime.engines.omni.qwen3.slots import Qwen3SlotDecoder
from omnimodel_runtime.engines.omni.thinker import OmniThinkerEngine


class Qwen3ThinkerEngine(OmniThinkerEngine):
    """``transformers`` adapter for the ``qwen3-omni-thinker`` task."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._special_ids: tuple[int, int, int] = (0, 0, 0)
        # The thinker layer whose hidden states the talker reads at audio/image/video positions (the whole
        # model's hidden_states[accept_hidden_layer]: 0 the input embeddings, N the final-normed output).
        self._accept_layer = 0

    def load_part(self) -> None:
        model_dir = self.context.model_dir
        config = load_config(model_dir)
        self.model = load_part(
            Qwen3OmniMoeThinkerForConditionalGeneration,
            model_dir,
            config.thinker_config,
            dtype=self.dtype,
            device=self.device,
        )
        # The whole model's generate() ends the text at <|im_end|> (its thinker_eos_token_id).
        self.model.generation_config.eos_token_id = int(config.im_end_token_id)
        tc = config.thinker_config
        self._placeholders = [tc.audio_token_id, tc.image_token_id, tc.video_token_id]
        self._special_ids = (config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id)
        if config.enable_audio_output:
            self._speakers = speakers(config.talker_config)
        self._accept_layer = int(config.talker_config.accept_hidden_layer)
        layers = int(tc.get_text_config().num_hidden_layers)
        if not 0 <= self._accept_layer <= layers:
            raise RuntimeError(f"talker_config.accept_hidden_layer {self._accept_layer} is not in 0..{layers}")
        self._processor = load_processor(model_dir, Qwen3OmniMoeProcessor)
        moe_experts(self, self.model)
        self.loaded(tc.get_text_config())

    def _slot_decoder(self, model: Any, lm_head: Any, **options: Any) -> Qwen3SlotDecoder:
        """The Qwen2.5 thinker's decode slots with Qwen3's query/key norms; text requests decode in them, a
        request with media runs whole through ``generate()`` (its M-RoPE shift). ``hidden=False``: Qwen3's
        talker reads the reply's embeddings alone, not the hidden state added to them."""
        return Qwen3SlotDecoder(model, lm_head, hidden=False, **options)

    def speaker_token(self, voice: str) -> int:
        """Qwen3-Omni starts a voice's speech with its codec id (the talker's vocabulary)."""
        assert self._speakers is not None
        return int(self._speakers[voice]["codec_id"])

    # The talker reads the voice as a codec id.
    speaker_meta = "speaker_id"

    def row_hooks(self, job: OmniJob, stream: Any) -> list[RemovableHandle]:
        hooks = super().row_hooks(job, stream)
        if job.data.get("media") is not None and 0 < self._accept_layer < len(self.text_model.layers):
            # The talker reads that decoder layer's output (before any deepstack visual features are added
            # to it, as the whole model records it) at the placeholders of the prompt: kept from the prefill.
            capture = job.data["accepted"] = _Prefill()
            hooks.append(self.text_model.layers[self._accept_layer - 1].register_forward_hook(capture))
        return hooks

    def prompt_rows(self, embeds: torch.Tensor, output: Any, job: OmniJob) -> torch.Tensor:
        """The prompt's input embeddings (the talker projects them itself, ``text_projection``), and at
        audio/image/video placeholders the hidden states of layer ``accept_hidden_layer`` (``hidden_projection``)."""
        if job.data.get("media") is None:
            return embeds
        if self._accept_layer == 0:
            hidden = embeds
        elif self._accept_layer == len(self.text_model.layers):
            hidden = output.last_hidden_state[0]
        else:
            hidden = job.data["accepted"].output[0]
        mask = self.placeholder_mask(job.data["prompt_ids"]).unsqueeze(-1)
        return torch.where(mask, hidden, embeds)

    def reply_rows(self, embeds: torch.Tensor, output: Any) -> torch.Tensor:
        return embeds

    def special_rows(self, speaker_bos: int) -> torch.Tensor:
        """The ``tts_bos``, ``tts_eos`` and ``tts_pad`` embeddings (thinker ``embed_tokens`` rows)."""
        ids = torch.tensor([self._special_ids], dtype=torch.long, device=self.device)
        rows: torch.Tensor = self.model.get_input_embeddings()(ids)[0]
        return rows


class _Prefill:
    """Forward hook keeping a module's output of its first call (the prefill's)."""

    def __init__(self) -> None:
        self.output: torch.Tensor | None = None

    def __call__(self, module: Any, args: Any, output: Any) -> None:
        if self.output is None:
            # A decoder layer returns its hidden states (a tuple led by them in some releases).
            self.output = output[0] if isinstance(output, tuple) else output
