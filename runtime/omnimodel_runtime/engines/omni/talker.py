"""The Qwen2.5-Omni talker stage: thinker rows in, codec codes out, as they are sampled.

Runs ``Qwen2_5OmniTalkerForConditionalGeneration.generate()`` with the arguments the whole model's
``generate()`` builds, so the codes are the whole model's codes. The one difference is when its input
exists: the whole model hands over every reply row at once, after the thinker has finished; here a forward
pre-hook supplies each decode step with the row it consumes (the talker uses row t at step t, then the
text-end row, then the text-pad row for as long as it keeps speaking), waiting for it if the thinker has
not produced it yet. So the talker starts on the thinker's first token and the two run side by side.

Sampling uses the request's own random stream (:class:`~omnimodel_runtime.engines.omni.common.RngTurn`,
seeded like the whole model: ``torch.manual_seed(seed)`` before ``generate()``); its final state goes to
code2wav, whose diffusion noise continues the same stream, as it does in the whole model.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from transformers import Qwen2_5OmniTalkerForConditionalGeneration, StoppingCriteria, StoppingCriteriaList

from omnimodel_runtime.engines.omni.common import (
    CODES_KIND,
    PROMPT_KIND,
    REPLY_KIND,
    RNG_KIND,
    RngTurn,
    generation_overrides,
    load_config,
    load_part,
    request_seed,
    rows_from_wire,
    tensor_frame,
)
from omnimodel_runtime.engines.omni.engine import OmniEngine, OmniJob
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    StageInput,
    StageParams,
    StageRequest,
    TensorFrame,
    Usage,
)

# The whole model's generate() defaults for its talker (eos/pad come from the talker config).
TALKER_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 4096,
    "do_sample": True,
    "top_k": 40,
    "top_p": 0.8,
    "temperature": 0.9,
    "repetition_penalty": 1.05,
}


class OmniTalkerEngine(OmniEngine):
    """``transformers`` adapter for the ``omni-talker`` task."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.model: Any = None
        self._generation: dict[str, Any] = dict(TALKER_DEFAULTS)
        self._eos: list[int] = []

    def load_part(self) -> None:
        model_dir = self.context.model_dir
        config = load_config(model_dir)
        self.model = load_part(
            Qwen2_5OmniTalkerForConditionalGeneration,
            model_dir,
            config.talker_config,
            dtype=self.dtype,
            device=self.device,
        )
        # The whole model ends speech on codec pad or end ([8292, 8294] in the released vocabulary).
        self._eos = [self.model.codec_pad_token, self.model.codec_eos_token]
        self._generation.update(generation_overrides(model_dir, "talker", self.args))
        self._generation.setdefault("eos_token_id", self._eos)

    async def warmup(self) -> None:
        hidden = int(self.model.config.embedding_size)
        rows = np.zeros((2, hidden), dtype=np.float32)
        dtype = str(self.model.dtype).removeprefix("torch.")
        if dtype == "bfloat16":
            rows = rows.astype(np.uint16)

        async def upstream() -> Any:
            yield tensor_frame(
                PROMPT_KIND,
                {
                    "prompt_rows": rows,
                    "prompt_ids": np.zeros(2, dtype=np.int64),
                    "special_rows": np.concatenate([rows, rows[:1]]),
                },
                dtype=dtype,
                speaker_bos_token=0,
            )
            yield tensor_frame(REPLY_KIND, {"rows": rows[:1], "token_ids": np.zeros(1, dtype=np.int64)}, dtype=dtype)
            yield FinalFrame("stop")

        request = StageRequest(
            request_id=f"warmup-{secrets.token_hex(4)}", prompt="", params=StageParams(talker_max_new_tokens=2)
        )
        async for _ in self.generate(StageInput(request=request, upstream=upstream())):
            pass

    def prepare(self, inp: StageInput, job: OmniJob) -> None:
        if inp.upstream is None:
            raise StageError("the talker takes its input from the thinker stage", status=400)
        job.data["seed"] = request_seed(inp.request)

    def run(self, job: OmniJob) -> None:
        frames = job.upstream()
        prompt, first = _head(frames)
        turn = RngTurn(self.device, job.data["seed"])
        if prompt is None or first is None:
            # The thinker stopped after one token: there is no reply to speak (the whole model needs two).
            self._finish(job, turn, codes=0, prompt_len=0)
            return
        param_dtype = self.model.dtype
        dtype = str(prompt.meta.get("dtype", "float32"))

        def rows(frame: TensorFrame, name: str) -> torch.Tensor:
            return rows_from_wire(frame.tensors[name], dtype, self.device).to(param_dtype)

        prompt_rows, special, reply0 = rows(prompt, "prompt_rows"), rows(prompt, "special_rows"), rows(first, "rows")
        prompt_ids = torch.from_numpy(np.array(prompt.tensors["prompt_ids"], dtype=np.int64)).to(self.device)
        n = prompt_ids.shape[0]
        speaker_bos = int(prompt.meta["speaker_bos_token"])
        first_token = int(first.tensors["token_ids"][0])
        model = self.model
        # Exactly the whole model's talker inputs: prompt rows, the speaker's bos row, the first reply row.
        inputs_embeds = torch.cat([prompt_rows, special[:1], reply0[:1]], dim=0).unsqueeze(0)
        input_ids = torch.cat(
            [
                torch.full((n,), model.codec_mask_token, dtype=torch.long, device=self.device),
                torch.tensor([model.codec_pad_token, model.codec_bos_token], dtype=torch.long, device=self.device),
            ]
        ).unsqueeze(0)
        text_ids = torch.cat(
            [prompt_ids, torch.tensor([speaker_bos, first_token], dtype=torch.long, device=self.device)]
        ).unsqueeze(0)
        source = _ReplyRows(_reply_rows(frames, rows, reply0[1:]), end=special[1:2], pad=special[2:3])

        def supply(module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            if kwargs.get("inputs_embeds") is None:  # a decode step (the prefill takes the prompt rows)
                kwargs["thinker_reply_part"] = source.next().reshape(1, 1, -1)
            return args, kwargs

        generation = dict(self._generation)
        cap = job.request.params.talker_max_new_tokens
        if cap is not None:
            generation["max_new_tokens"] = min(cap, int(generation["max_new_tokens"]))
        criterion = _Codes(
            self, job, turn, eos=set(generation["eos_token_id"]), limit=int(generation["max_new_tokens"])
        )
        hooks = [
            model.register_forward_pre_hook(supply, with_kwargs=True),
            model.register_forward_hook(lambda *_: turn.begin()),
        ]
        try:
            model.generate(
                input_ids=input_ids,
                input_text_ids=text_ids,
                # Replaced step by step by `supply`; generate() only needs the argument to exist.
                thinker_reply_part=torch.zeros_like(reply0[:1]).unsqueeze(0),
                inputs_embeds=inputs_embeds,
                attention_mask=torch.ones((1, n + 2), dtype=torch.long, device=self.device),
                suppress_tokens=[model.codec_bos_token],
                pad_token_id=model.codec_pad_token,
                use_audio_in_video=False,
                stopping_criteria=StoppingCriteriaList([criterion]),
                **generation,
            )
        finally:
            for hook in hooks:
                hook.remove()
            turn.end()
        self._finish(job, turn, codes=criterion.count, prompt_len=n + 2, reason=criterion.reason)

    def _finish(self, job: OmniJob, turn: RngTurn, *, codes: int, prompt_len: int, reason: str = "stop") -> None:
        state = turn.state.to("cpu").numpy()
        job.emit(tensor_frame(RNG_KIND, {"rng_state": state}, device=torch.device(self.device).type))
        job.emit(FinalFrame(reason, Usage(prompt_tokens=prompt_len, completion_tokens=codes)))


def _head(frames: Iterator[ResponseFrame]) -> tuple[TensorFrame | None, TensorFrame | None]:
    """The thinker's prompt frame and its first reply row (``None`` when it ended before them)."""
    prompt = None
    for frame in frames:
        if isinstance(frame, TensorFrame) and frame.meta.get("kind") == PROMPT_KIND:
            prompt = frame
        elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == REPLY_KIND:
            return prompt, frame
        elif isinstance(frame, FinalFrame):
            break
    return prompt, None


def _reply_rows(frames: Iterator[ResponseFrame], rows: Any, first: torch.Tensor) -> Iterator[torch.Tensor]:
    """Reply rows one at a time, blocking on the thinker (text frames are the client's, not ours)."""
    yield from first
    for frame in frames:
        if isinstance(frame, TensorFrame) and frame.meta.get("kind") == REPLY_KIND:
            yield from rows(frame, "rows")
        elif isinstance(frame, FinalFrame):
            return


class _ReplyRows:
    """Row t for talker step t: reply rows while the thinker has them, then text-end, then text-pad for
    as long as the talker keeps speaking (the whole model's ``thinker_reply_part`` tail)."""

    def __init__(self, rows: Iterator[torch.Tensor], *, end: torch.Tensor, pad: torch.Tensor) -> None:
        self._rows = rows
        self._tail = [end[0], pad[0]]
        self._done = False

    def next(self) -> torch.Tensor:
        if not self._done:
            row = next(self._rows, None)
            if row is not None:
                return row
            self._done = True
        return self._tail.pop(0) if len(self._tail) > 1 else self._tail[0]


class _Codes(StoppingCriteria):  # type: ignore[misc]  # transformers is untyped here
    """Streams each sampled code to code2wav and ends the request's turn on the global generator."""

    def __init__(self, engine: OmniTalkerEngine, job: OmniJob, turn: RngTurn, *, eos: set[int], limit: int) -> None:
        self.engine = engine
        self.job = job
        self.turn = turn
        self.eos = eos
        self.limit = limit
        self.count = 0
        self.reason = "length"
        self.done = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        self.turn.end()
        code = int(input_ids[0, -1])
        metrics = self.engine.context.metrics
        metrics.observe_batch(1)
        if code in self.eos:
            self.done, self.reason = True, "stop"
        else:
            self.count += 1
            metrics.add_generated_tokens(1)
            self.job.emit(tensor_frame(CODES_KIND, {"codes": np.array([code], dtype=np.int64)}))
            self.done = self.count >= self.limit
            self.job.check()
        return torch.full((input_ids.shape[0],), self.done, dtype=torch.bool, device=input_ids.device)
