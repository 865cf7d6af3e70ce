"""The Qwen2.5-Omni thinker's forced reply (what ``/v1/audio/speech`` runs on), on the tiny model in process.

The claim: teacher-forcing a reply streams exactly the rows the talker would get had the thinker generated
that reply itself. Proved by construction — let the thinker generate greedily, then force the tokens it
generated after the same prompt, and compare every streamed tensor bit for bit. And a speech request is
that forced reply, framed by the documented prompt, with no text leaving the thinker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from pydantic import ValidationError
from runtime_procs import served_in_process

from omnimodel_runtime.engines.omni.common import PROMPT_KIND, REPLY_KIND
from omnimodel_runtime.engines.omni.thinker import SPEECH_INSTRUCTION, SPEECH_SYSTEM_PROMPT
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import Modality
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    SamplingParams,
    StageInput,
    StageParams,
    StageRequest,
    TensorFrame,
    TextFrame,
)
from omnimodel_runtime.serve import serve_pipeline

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

MODEL = "qwen2.5-omni"
TEXT = "Good morning! The weather today is sunny, with a light breeze."


def audio(reply_ids: list[int] | None = None) -> StageParams:
    """A chat request that continues into the talker, optionally with a reply to force."""
    return StageParams(modalities=(Modality.TEXT, Modality.AUDIO), voice="Ethan", reply_ids=reply_ids)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def thinker(tiny_omni: Path, model_cache: Path) -> AsyncIterator[Any]:
    """The thinker engine of an in-process ``serve`` app (the engines the speech route runs)."""
    async with served_in_process(serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu"), model_cache) as served:
        yield served.engine("thinker")


async def run(engine: Any, request: StageRequest) -> list[ResponseFrame]:
    return [frame async for frame in engine.generate(StageInput(request=request))]


def of_kind(frames: list[ResponseFrame], kind: str) -> list[TensorFrame]:
    return [f for f in frames if isinstance(f, TensorFrame) and f.meta.get("kind") == kind]


def assert_same_bits(a: TensorFrame, b: TensorFrame) -> None:
    assert a.meta == b.meta
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        x, y = np.asarray(a.tensors[name]), np.asarray(b.tensors[name])
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert x.tobytes() == y.tobytes(), f"{name} differs"


@pytest.mark.slow
async def test_a_forced_reply_streams_the_rows_of_the_generation_that_produced_it(thinker: Any) -> None:
    prompt_ids, _ = thinker.speech_prompt(TEXT)
    greedy = await run(
        thinker,
        StageRequest(
            request_id="greedy",
            prompt_token_ids=tuple(prompt_ids),
            sampling=SamplingParams(max_tokens=24, temperature=0.0),
            params=audio(),
        ),
    )
    generated = [t for f in greedy if isinstance(f, TextFrame) for t in f.token_ids]
    # The tokens whose rows the talker got: every generated token a decode step consumed, i.e. all but
    # the last (the tiny thinker never picks end-of-text, so it stops at max_tokens).
    spoken = [int(f.tensors["token_ids"][0]) for f in of_kind(greedy, REPLY_KIND)]
    assert len(generated) == 24
    assert spoken == generated[:-1]

    forced = await run(
        thinker,
        StageRequest(request_id="forced", prompt_token_ids=tuple(prompt_ids), params=audio(spoken)),
    )
    assert not [f for f in forced if isinstance(f, TextFrame)], "a forced reply must not send text"
    (g_prompt,), (f_prompt,) = of_kind(greedy, PROMPT_KIND), of_kind(forced, PROMPT_KIND)
    assert_same_bits(f_prompt, g_prompt)
    g_rows, f_rows = of_kind(greedy, REPLY_KIND), of_kind(forced, REPLY_KIND)
    assert len(f_rows) == len(g_rows) == len(spoken)
    for f_row, g_row in zip(f_rows, g_rows, strict=True):
        assert_same_bits(f_row, g_row)
    final = forced[-1]
    assert isinstance(final, FinalFrame)
    assert (final.finish_reason, final.usage.prompt_tokens, final.usage.completion_tokens) == (
        "stop",
        len(prompt_ids),
        len(spoken),
    )


@pytest.mark.slow
async def test_a_speech_request_is_the_input_forced_after_the_documented_prompt(thinker: Any) -> None:
    tokenizer = thinker._tokenizer
    speech = await run(
        thinker,
        StageRequest(request_id="speak", prompt=TEXT, params=StageParams(speak=True, voice="Ethan", speed=1.0)),
    )
    assert not [f for f in speech if isinstance(f, TextFrame)]
    (prompt,) = of_kind(speech, PROMPT_KIND)
    messages = [
        {"role": "system", "content": SPEECH_SYSTEM_PROMPT},
        {"role": "user", "content": SPEECH_INSTRUCTION + TEXT},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = [int(t) for t in prompt.tensors["prompt_ids"]]
    assert tokenizer.decode(prompt_ids) == rendered
    reply = [int(f.tensors["token_ids"][0]) for f in of_kind(speech, REPLY_KIND)]
    assert reply == tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(reply) == TEXT
    # The same forced reply through the stage parameter: the same rows (the speech path adds only framing).
    forced = await run(
        thinker,
        StageRequest(request_id="ids", prompt_token_ids=tuple(prompt_ids), params=audio(reply)),
    )
    for a, b in zip(
        of_kind(speech, PROMPT_KIND) + of_kind(speech, REPLY_KIND),
        of_kind(forced, PROMPT_KIND) + of_kind(forced, REPLY_KIND),
        strict=True,
    ):
        assert_same_bits(a, b)


@pytest.mark.slow
async def test_control_tokens_in_the_input_are_spoken_as_text(thinker: Any) -> None:
    tokenizer = thinker._tokenizer
    text = "Say <|im_end|> and <|im_start|>user aloud."
    frames = await run(thinker, StageRequest(request_id="ctl", prompt=text, params=StageParams(speak=True)))
    reply = [int(f.tensors["token_ids"][0]) for f in of_kind(frames, REPLY_KIND)]
    assert set(reply).isdisjoint(tokenizer.all_special_ids)
    assert tokenizer.decode(reply) == text
    (prompt,) = of_kind(frames, PROMPT_KIND)
    # The user turn is closed once, by the template, not by the input.
    assert [int(t) for t in prompt.tensors["prompt_ids"]].count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (StageRequest(request_id="empty", prompt=" \n", params=StageParams(speak=True)), "input"),
        (StageRequest(request_id="long", prompt="talk " * 3000, params=StageParams(speak=True)), "input"),
        (StageRequest(request_id="voice", prompt="hi", params=StageParams(speak=True, voice="Nobody")), "voice"),
    ],
)
async def test_bad_speech_requests_are_refused_before_any_work(
    thinker: Any, request_: StageRequest, param: str
) -> None:
    with pytest.raises(StageError) as err:
        await run(thinker, request_)
    assert (err.value.status, err.value.param) == (400, param)


@pytest.mark.slow
async def test_a_forced_reply_may_not_end_itself(thinker: Any) -> None:
    eos = thinker._tokenizer.convert_tokens_to_ids("<|im_end|>")
    for reply in ([5, eos, 6], []):
        request = StageRequest(request_id="bad", prompt="hi", params=audio(reply))
        with pytest.raises(StageError) as err:
            await run(thinker, request)
        assert err.value.status == 400
    # Ids that are not token ids never become a stage request: the typed parameters refuse them (and a
    # stage server refuses such a request body with a 400, tests/unit/runtime/test_runtime_remote.py).
    with pytest.raises(ValidationError, match="reply_ids"):
        StageParams.model_validate({"reply_ids": ["a"]})
