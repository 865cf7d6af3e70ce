"""A thinker request's prompt where it is more than a chat: a speech request's (``/v1/audio/speech``: the
text framed as the answer to "repeat this text", and the reply it forces) and a request's with audio, images
or video (token ids and encoder inputs from the checkpoint's processor). The engine that uses them is
:mod:`~omnimodel_runtime.engines.omni.thinker`."""

from __future__ import annotations

import threading
from typing import Any, Final

from omnimodel_runtime.engines.omni.common import USE_AUDIO_IN_VIDEO
from omnimodel_runtime.engines.omni.inputs import decode, processor_inputs
from omnimodel_runtime.engines.text.common import check_token_ids
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import Modality
from omnimodel_runtime.protocol.stage import StageInput, StageRequest

# The released model's default system prompt. Its model card: audio output works as expected only with
# this system prompt, so a speech request is framed by it too.
SPEECH_SYSTEM_PROMPT: Final = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)
# The user turn before the input text: with it, the forced reply is the answer the model itself would most
# likely give, so the forced rows look like the rows of its own generation (what the talker learnt from).
SPEECH_INSTRUCTION: Final = "Repeat the following text exactly as it is written, and say nothing else:\n"
# Stands in for the input text while the chat template is rendered (it never reaches the tokenizer).
_TEXT_MARK: Final = "\x00omnimodel-speech-input\x00"


def wants_audio(request: StageRequest) -> bool:
    """Whether this request continues into the talker (the gateway says so in ``params``)."""
    return request.params.speak or Modality.AUDIO in request.params.modalities


def _reply_ids(request: StageRequest, vocab: int, eos: frozenset[int]) -> list[int] | None:
    """The reply to teacher-force when the request gives one (speech requests get theirs from their text)."""
    given = request.params.reply_ids
    if given is None:
        return None
    check_token_ids(given, vocab, param="reply_ids")
    if eos.intersection(given):
        # generate() would stop at it: the reply would end early and silently.
        raise StageError("reply_ids must not contain end-of-sequence tokens", status=400)
    return list(given)


def speech_frame(tokenizer: Any, system: str, instruction: str) -> tuple[list[int], list[int]] | None:
    """Token ids of the speech prompt before and after the input text: system = ``system``, user =
    ``instruction`` followed by the text, then the assistant's turn (None: the chat template does not render
    a user message verbatim, so the text has no known place)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": instruction + _TEXT_MARK}]
    rendered = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    parts = rendered.split(_TEXT_MARK)
    if len(parts) != 2:
        return None
    head, tail = (tokenizer.encode(p, add_special_tokens=False) for p in parts)
    return head, tail


def media_prompt(processor: Any, lock: threading.Lock, inp: StageInput, vocab: int) -> dict[str, Any]:
    """The prompt of a request with audio, images or video: its token ids (each placeholder expanded
    to one token per encoder output) and the encoders' inputs, all from the checkpoint's ``processor``
    (``None``: it ships none), whose tokenizer is used under ``lock`` (it is not safe to share)."""
    request = inp.request
    if processor is None:
        raise StageError(
            "this checkpoint ships no processor config (preprocessor_config.json): audio, image and "
            "video input are not available",
            status=400,
            param=request.media[0].param,
        )
    rate = int(processor.feature_extractor.sampling_rate)
    decoded = decode(request, inp.tensors, rate, processor.video_processor)
    with lock:
        try:
            text = processor.tokenizer.apply_chat_template(
                [dict(m) for m in request.messages or ()], add_generation_prompt=True, tokenize=False
            )
        except Exception as err:  # jinja errors and template-raised exceptions alike
            raise StageError(f"cannot apply the chat template: {err}", status=400, param="messages") from err
        inputs = processor_inputs(processor, str(text), decoded)
    prompt_ids: list[int] = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    check_token_ids(prompt_ids, vocab)
    return {"prompt_ids": prompt_ids, "inputs": inputs, USE_AUDIO_IN_VIDEO: decoded.use_audio_in_video}
