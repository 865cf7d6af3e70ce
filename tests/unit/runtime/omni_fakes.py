"""Fake stage engines shaped like Qwen2.5-Omni's thinker, talker and code2wav, and the gateway app serving
them in process (``OmniServe``): what the omni unit tests (chat with audio, speech) run against."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
from prometheus_client import CollectorRegistry
from runtime_fakes import fake_context, omni_pipeline

from omnimodel_runtime.engines.base import Engine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.gateway import build_app
from omnimodel_runtime.metrics import StageMetricsFamily
from omnimodel_runtime.protocol.speech import resolve_voice
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageInput, TensorFrame, TextFrame, Usage
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage

WORDS = 6
RATE = 24000
VOICES = ("Chelsie", "Ethan")


class Thinker(Engine):
    """WORDS text deltas, each followed by a row; for the streaming test it holds back its last word
    until audio has reached the client (``go``)."""

    async def start(self) -> None:
        self.go = asyncio.Event()
        self.go.set()
        self.requests: list[StageInput] = []
        self.voices: list[str] = []

    async def stop(self) -> None:
        pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.requests.append(inp)
        # The real stages' resolution of a voice onto the speaker map.
        self.voices.append(resolve_voice(inp.request.params.voice, VOICES, VOICES[0], param="audio.voice"))
        for i in range(WORDS):
            if i == WORDS - 1:
                await self.go.wait()
            yield TextFrame(text=f" w{i}", token_ids=(i,))
            yield TensorFrame({"rows": np.full((1, 4), i, dtype=np.float32)}, meta={"kind": "omni.thinker.reply"})
        yield FinalFrame("stop", Usage(prompt_tokens=3, completion_tokens=WORDS))


class Talker(Engine):
    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        assert inp.upstream is not None
        async for frame in inp.upstream:
            if isinstance(frame, TensorFrame):
                yield TensorFrame({"codes": np.array([int(frame.tensors["rows"][0, 0])])}, meta={"kind": "codes"})
        yield FinalFrame("stop", Usage(completion_tokens=WORDS))


class Code2Wav(Engine):
    """One audio chunk per code: a 10 ms constant tone at amplitude (code + 1) / 10; FAIL_AUDIO in the
    prompt makes it fail after its first chunk."""

    async def start(self) -> None:
        self.requests: list[StageInput] = []

    async def stop(self) -> None:
        pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.requests.append(inp)
        assert inp.upstream is not None
        fail = "FAIL_AUDIO" in str(inp.request.messages)
        async for frame in inp.upstream:
            if isinstance(frame, TensorFrame):
                code = int(frame.tensors["codes"][0])
                yield TensorFrame(
                    {"audio": np.full(RATE // 100, (code + 1) / 10, dtype=np.float32)},
                    meta={"modality": "audio", "sample_rate": RATE},
                )
                if fail:
                    raise StageError("vocoder exploded", status=500)
        yield FinalFrame("stop")


class OmniServe:
    """The gateway app of the fake omni stages, each a local stage."""

    def __init__(self, settings: RuntimeSettings | None = None) -> None:
        self.pipeline = omni_pipeline()
        registry = CollectorRegistry()
        family = StageMetricsFamily(registry)
        thinker, talker, code2wav = self.pipeline.stages
        self.thinker = Thinker(fake_context(thinker))
        self.code2wav = Code2Wav(fake_context(code2wav))
        engines = {"thinker": self.thinker, "talker": Talker(fake_context(talker)), "code2wav": self.code2wav}
        handles: dict[str, StageHandle] = {
            s.name: LocalStage(s, engines[s.name], family.for_stage(s.name)) for s in self.pipeline.stages
        }
        self.app = build_app(settings or RuntimeSettings(), self.pipeline, handles, registry=registry)


def expected_waveform() -> np.ndarray:
    return np.concatenate([np.full(RATE // 100, (i + 1) / 10, dtype=np.float32) for i in range(WORDS)])
