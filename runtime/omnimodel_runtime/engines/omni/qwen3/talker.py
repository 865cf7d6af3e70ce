"""The Qwen3-Omni talker stage (:class:`Qwen3TalkerEngine`): the whole model's talker inputs from the
thinker's rows, then ``Qwen3OmniMoeTalkerForConditionalGeneration.generate()``: each step samples a
first-group code and the next step's code predictor draws its residual codes; one frame of
``num_code_groups`` codes goes to code2wav per step. One request at a time it starts when the thinker has
finished (the whole model projects the assistant's text in one batch; projecting rows as they arrive rounds
differently); batched (``engine_args.batching``) it is :mod:`.batched_talker`'s, which starts on the first
reply row."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerForConditionalGeneration

from omnimodel_runtime.engines.devices import sdpa_scope
from omnimodel_runtime.engines.omni.common import (
    AUDIO_LENGTHS,
    CODES_KIND,
    IMAGE_GRID,
    PROMPT_KIND,
    REPLY_KIND,
    VIDEO_GRID,
    VIDEO_SECONDS,
    RngTurn,
    generate,
    generation_overrides,
    load_part,
    request_seed,
    rows_from_wire,
    rows_to_wire,
    tensor_frame,
)
from omnimodel_runtime.engines.omni.engine import OmniEngine, OmniJob
from omnimodel_runtime.engines.omni.qwen3.common import (
    SUPPRESSED_TAIL,
    TALKER_DEFAULTS,
    fused_experts_loading,
    lend_audio_config,
    load_config,
    moe_experts,
)
from omnimodel_runtime.engines.omni.talker import warm_up_talker
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import FinalFrame, StageInput, TensorFrame, Usage

if TYPE_CHECKING:
    from omnimodel_runtime.engines.omni.qwen3.batched_talker import BatchedTalker


class Qwen3TalkerEngine(OmniEngine):
    """``transformers`` adapter for the ``qwen3-omni-talker`` task."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.model: Any = None
        self.config: Any = None
        self._generation: dict[str, Any] = dict(TALKER_DEFAULTS)
        self._stream_priority = -1  # ahead of code2wav on a shared GPU
        self._batch: BatchedTalker | None = None  # batched serving

    def load_part(self) -> None:
        model_dir = self.context.model_dir
        self.config = config = load_config(model_dir)
        fused_experts_loading(Qwen3OmniMoeTalkerForConditionalGeneration)
        self.model = load_part(
            Qwen3OmniMoeTalkerForConditionalGeneration,
            model_dir,
            config.talker_config,
            dtype=self.dtype,
            device=self.device,
        )
        lend_audio_config(self.model, config)
        tc = config.talker_config
        vocab = int(tc.text_config.vocab_size)
        eos = int(tc.codec_eos_token_id)
        self._generation["eos_token_id"] = eos
        self._generation["suppress_tokens"] = [i for i in range(vocab - SUPPRESSED_TAIL, vocab) if i != eos]
        self._generation.update(generation_overrides(model_dir, "talker", self.args))
        moe_experts(self, self.model)
        if self.batched:
            from omnimodel_runtime.engines.omni.qwen3.batched_talker import BatchedTalker  # noqa: PLC0415

            self._batch = BatchedTalker(self)

    async def warmup(self) -> None:
        c = self.config
        ids = [c.im_start_token_id, c.user_token_id, c.im_end_token_id, c.im_start_token_id, c.assistant_token_id, 0]
        hidden = int(c.talker_config.thinker_hidden_size)
        rows, dtype = rows_to_wire(torch.zeros((len(ids), hidden), dtype=self.model.dtype))
        tensors = {"prompt_rows": rows, "prompt_ids": np.array(ids, dtype=np.int64), "special_rows": rows[:3]}
        speaker = next(iter(c.talker_config.speaker_id.values()))
        await warm_up_talker(self, tensor_frame(PROMPT_KIND, tensors, dtype=dtype, speaker_id=speaker))

    def prepare(self, inp: StageInput, job: OmniJob) -> None:
        if inp.upstream is None:
            raise StageError("the talker takes its input from the thinker stage", status=400)
        job.data["seed"] = request_seed(inp.request)

    def run(self, job: OmniJob) -> None:
        prompt: TensorFrame | None = None
        replies: list[TensorFrame] = []
        for frame in job.upstream():
            if isinstance(frame, TensorFrame) and frame.meta.get("kind") == PROMPT_KIND:
                prompt = frame
            elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == REPLY_KIND:
                replies.append(frame)
            elif isinstance(frame, FinalFrame):
                break
        if prompt is None or not replies:
            # The thinker stopped after one token: nothing to speak (the whole model needs two).
            job.emit(FinalFrame("stop", Usage()))
            return
        inputs = self.inputs(prompt, replies)
        generation = self.generation_for(job)
        turn = RngTurn(self.device, job.data["seed"])
        criterion = _Stop(self, job, turn, eos=int(generation["eos_token_id"]))
        model = self.model

        def codes(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            # A decode step's input carries the previous step's code with its residual codes (the code
            # predictor's draws): that whole frame goes to code2wav.
            residual = kwargs.get("residual_codes")
            if residual is not None:
                criterion.count += 1
                self.context.metrics.add_generated_tokens(1)
                job.emit(tensor_frame(CODES_KIND, {"codes": residual[0].to("cpu", torch.int64).numpy()}))
            turn.begin()

        hooks = [
            # The code predictor draws (from the global generator) before the talker's own forward.
            model.code_predictor.register_forward_pre_hook(lambda *_: turn.begin()),
            model.register_forward_hook(codes, with_kwargs=True),
        ]
        try:
            with warnings.catch_warnings():
                # What the whole model does: its talker gets only inputs_embeds, so the repetition penalty
                # counts the codes it generates, not the prompt (transformers warns about that every call).
                warnings.filterwarnings("ignore", message="Passing `repetition_penalty` with `inputs_embeds`")
                with sdpa_scope(self.prefill_attention):
                    generate(
                        model,
                        **inputs,
                        stopping_criteria=StoppingCriteriaList([criterion]),
                        output_hidden_states=True,
                        return_dict_in_generate=True,
                        **generation,
                    )
        finally:
            for hook in hooks:
                hook.remove()
            turn.end()
        prompt_len = int(inputs["inputs_embeds"].shape[1])
        job.emit(FinalFrame(criterion.reason, Usage(prompt_tokens=prompt_len, completion_tokens=criterion.count)))

    def generation_for(self, job: OmniJob) -> dict[str, Any]:
        """The generation parameters of ``job``'s talker (the request's code cap applied)."""
        generation = dict(self._generation)
        cap = job.request.params.talker_max_new_tokens
        if cap is not None:
            generation["max_new_tokens"] = min(cap, int(generation["max_new_tokens"]))
        return generation

    def advance(self, jobs: list[OmniJob]) -> tuple[list[OmniJob], bool]:
        assert self._batch is not None
        return self._batch.advance(jobs)

    def release(self, job: OmniJob) -> None:
        if self._batch is not None:
            self._batch.release(job)

    def inputs(self, prompt: TensorFrame, replies: list[TensorFrame]) -> dict[str, torch.Tensor]:
        """The whole model's talker inputs (its ``generate()`` steps 2, batch of one) from the thinker's rows
        of the prompt (input embeddings; at audio/image/video placeholders layer ``accept_hidden_layer``'s hidden
        states) and of every consumed reply token (input embeddings)."""
        c, tc, model, device = self.config, self.config.talker_config, self.model, self.device
        dtype = str(prompt.meta.get("dtype", "float32"))

        def rows(frame: TensorFrame, name: str) -> torch.Tensor:
            return rows_from_wire(frame.tensors[name], dtype, device).to(model.dtype)

        prompt_ids = torch.from_numpy(np.array(prompt.tensors["prompt_ids"], dtype=np.int64)).to(device)
        thinker_embed = torch.cat([rows(prompt, "prompt_rows"), *(rows(f, "rows") for f in replies)]).unsqueeze(0)
        reply_ids = [int(f.tensors["token_ids"][0]) for f in replies]
        input_ids = prompt_ids.unsqueeze(0)
        length = input_ids.shape[1]
        # User turns: every position whose turn (the token after the last <|im_start|>) is "user".
        positions = torch.arange(length, device=device).unsqueeze(0)
        starts = torch.where(input_ids == c.im_start_token_id, positions, positions.new_full((), -1))
        previous = torch.cummax(starts, dim=-1).values.clamp_min(0)
        roles = input_ids.gather(1, (previous + 1).clamp_max(length - 1))
        user_mask = (roles == c.user_token_id)[0]
        # Projected as the whole model projects them: the multimodal positions' hidden states in one batch
        # through hidden_projection, every other prompt position's embedding in one through text_projection
        # (a Linear's rounding can depend on its batch: docs/pipelines/qwen3-omni.md).
        media = torch.isin(
            prompt_ids, torch.tensor([tc.audio_token_id, tc.image_token_id, tc.video_token_id], device=device)
        )
        prompt_rows = thinker_embed[0, :length]
        projected = torch.empty((length, tc.text_config.hidden_size), device=device, dtype=model.dtype)
        if media.any():
            projected[media] = model.hidden_projection(prompt_rows[media])
        projected[~media] = model.text_projection(prompt_rows[~media])
        user_embeds = projected[user_mask].unsqueeze(0)
        user_ids = input_ids[:, user_mask]
        # The assistant turn being answered: its <|im_start|>assistant\n, then the reply.
        starts_at = torch.nonzero(
            (input_ids[0, :-1] == c.im_start_token_id) & (input_ids[0, 1:] == c.assistant_token_id)
        )
        if starts_at.numel() == 0:
            raise StageError("the prompt has no assistant turn to speak", status=400)
        start = int(starts_at.flatten()[-1])
        special = model.text_projection(rows(prompt, "special_rows").unsqueeze(0))
        tts_bos, tts_eos, tts_pad = special.chunk(3, dim=1)
        assistant = model.text_projection(thinker_embed[:, start:])
        text_part = torch.cat((assistant[:, :3], tts_pad.expand(1, 4, -1), tts_bos, assistant[:, 3:4]), dim=1)
        codec_ids = torch.tensor(
            [
                [
                    tc.codec_nothink_id,
                    tc.codec_think_bos_id,
                    tc.codec_think_eos_id,
                    int(prompt.meta["speaker_id"]),
                    tc.codec_pad_id,
                    tc.codec_bos_id,
                ]
            ],
            dtype=torch.long,
            device=device,
        )
        codec_part = torch.cat(
            (
                torch.zeros((1, 3, tc.text_config.hidden_size), device=device, dtype=model.dtype),
                model.get_input_embeddings()(codec_ids),
            ),
            dim=1,
        )
        trailing = torch.cat((assistant[:, 4:], tts_eos), dim=1)
        # A reply with <|im_end|> inside it (ignore_eos): the whole model speaks up to it, then pads.
        ends = [j for j, token in enumerate(reply_ids) if token == c.im_end_token_id]
        if ends:
            first = ends[0]
            index = torch.arange(trailing.shape[1], device=device).view(1, -1, 1)
            trailing = torch.where(index > first, tts_pad.to(trailing.dtype), trailing)
            trailing = torch.where(index == first, tts_eos.to(trailing.dtype), trailing)
        embeds = torch.cat((user_embeds, text_part + codec_part), dim=1)
        ids = torch.cat(
            (user_ids, torch.full((1, text_part.shape[1]), c.tts_pad_token_id, dtype=torch.long, device=device)), dim=1
        )
        # The talker's M-RoPE positions of the media: each audio's feature length (a video's track among
        # them), each image's and video's patch grid, each video's seconds per temporal patch (float32, as the
        # processor gives it: it scales the time positions). Not use_audio_in_video: the whole model's
        # generate() hands it to the thinker only, and its talker lays out a video's interleaved track as
        # without it, so the split does the same.
        grids = {
            name: torch.from_numpy(np.array(prompt.tensors[name], dtype=np.int64)).to(device)
            for name in (AUDIO_LENGTHS, IMAGE_GRID, VIDEO_GRID)
            if name in prompt.tensors
        }
        if VIDEO_SECONDS in prompt.tensors:
            seconds = np.array(prompt.tensors[VIDEO_SECONDS], dtype=np.float32)
            grids[VIDEO_SECONDS] = torch.from_numpy(seconds).to(device)
        return {
            "inputs_embeds": embeds,
            "trailing_text_hidden": trailing,
            "tts_pad_embed": tts_pad,
            "talker_input_ids": ids,
            "attention_mask": torch.ones(ids.shape, dtype=torch.long, device=device),
            **grids,
        }


class _Stop(StoppingCriteria):  # type: ignore[misc]  # transformers is untyped here
    """Right after each first-group code is drawn: ends the request's turn on the global generator, stops at
    end-of-speech, checks cancellation. (The code's frame leaves with the next step, with its residuals.)"""

    def __init__(self, engine: Qwen3TalkerEngine, job: OmniJob, turn: RngTurn, *, eos: int) -> None:
        self.engine = engine
        self.job = job
        self.turn = turn
        self.eos = eos
        self.count = 0
        self.reason = "length"

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        self.turn.end()
        self.engine.context.metrics.observe_batch(1)
        done = int(input_ids[0, -1]) == self.eos
        if done:
            self.reason = "stop"
        else:
            self.job.check()
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)
