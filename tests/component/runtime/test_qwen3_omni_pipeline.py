"""Qwen3-Omni split into thinker -> talker -> code2wav stages (``omnimodel serve``'s app, in process, over a
real TCP port for the streamed answer), on the tiny random-weight model, against the whole
``Qwen3OmniMoeForConditionalGeneration.generate()``.

The equality is exact: the text token for token, and the WAV the client receives is byte for byte the
whole model's waveform in 16-bit PCM (same seed; greedy thinker, sampling talker and code predictor). A
streamed answer runs code2wav in chunks of 12 codes with left context and one code of look-ahead; it stays
within :data:`STREAM_TOLERANCE_LSB` of the whole model's waveform.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
from runtime_procs import served_over_tcp, stage_requests, wav_of

from omnimodel_runtime.serve import build_serve_app, serve_pipeline
from omnimodel_runtime.serving.audio import wav_bytes
from omnimodel_runtime.settings import RuntimeSettings

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    # The whole model's talker generate() warns that its repetition penalty skips the prompt (by design).
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`:UserWarning"),
]

MODEL = "qwen3-omni"
USER = [{"role": "user", "content": "Hello there, who are you and what can you do?"}]
SYSTEM = [{"role": "system", "content": "You are a tiny model."}, *USER]
# Streamed audio vs the whole model's (one vocoder pass over every code), in 16-bit PCM steps.
STREAM_TOLERANCE_LSB = 1


@dataclass
class Whole:
    """The unsplit ``Qwen3OmniMoeForConditionalGeneration`` loaded from the same checkpoint."""

    model_dir: Path

    @cached_property
    def model(self) -> Any:
        from transformers import Qwen3OmniMoeForConditionalGeneration

        return Qwen3OmniMoeForConditionalGeneration.from_pretrained(self.model_dir).eval()

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def generate(
        self, messages: list[Mapping[str, str]], *, speaker: str, max_tokens: int, seed: int
    ) -> tuple[str, np.ndarray]:
        """The whole model's reply text and float waveform."""
        import torch

        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        generation = json.loads((self.model_dir / "omni_generation_config.json").read_text())["talker"]
        torch.manual_seed(seed)
        sequences, waveform = self.model.generate(
            **inputs,
            speaker=speaker,
            thinker_max_new_tokens=max_tokens,
            thinker_do_sample=False,
            # The default is the released vocabulary's <|im_end|> (151645); the tiny vocabulary has its own.
            thinker_eos_token_id=self.model.config.im_end_token_id,
            talker_max_new_tokens=generation["max_new_tokens"],
        )
        reply = self.tokenizer.decode(sequences[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
        return reply, waveform.reshape(-1).numpy()


@pytest.fixture(scope="module")
def tiny(model_cache: Path) -> Path:
    from omnimodel_runtime.tiny import ensure_tiny

    return ensure_tiny(MODEL, model_cache)


@pytest.fixture(scope="module")
def whole(tiny: Path) -> Whole:
    return Whole(tiny)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def serve(tiny: Path, model_cache: Path) -> AsyncIterator[httpx.AsyncClient]:
    """``omnimodel serve --preset qwen3-omni --model tiny://qwen3-omni``: every stage in this process."""
    settings = RuntimeSettings(model_cache=model_cache, device="cpu")
    app = build_serve_app(settings, serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu"))
    async with app.router.lifespan_context(app):
        await app.state.startup.wait()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=120) as http:
            yield http


@pytest.mark.parametrize(("voice", "messages"), [("Ethan", USER), ("Chelsie", SYSTEM)])
async def test_split_stages_reproduce_the_whole_model_text_and_waveform(
    serve: httpx.AsyncClient, whole: Whole, voice: str, messages: list[dict[str, str]]
) -> None:
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=serve, max_retries=0)
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        modalities=["text", "audio"],
        audio={"voice": voice, "format": "wav"},  # type: ignore[typeddict-item]
        max_tokens=16,
        temperature=0,
        seed=5,
    )
    message = reply.choices[0].message
    assert message.audio is not None
    text, waveform = whole.generate(messages, speaker=voice, max_tokens=16, seed=5)
    assert message.content == text
    assert message.audio.transcript == text
    assert wav_of(message.model_dump()) == wav_bytes(waveform, 24000)


async def test_voices_differ_and_the_default_is_the_whole_models(serve: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": USER, "modalities": ["text", "audio"], "max_tokens": 8, "temperature": 0}

    async def wav(**voice: Any) -> bytes:
        resp = await serve.post("/v1/chat/completions", json={**body, "seed": 3, **voice})
        assert resp.status_code == 200, resp.text
        return wav_of(resp.json()["choices"][0]["message"])

    ethan = await wav()
    assert await wav(audio={"voice": "ethan"}) == ethan != await wav(audio={"voice": "Aiden"})
    resp = await serve.post("/v1/chat/completions", json={**body, "audio": {"voice": "Nobody"}})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "audio.voice"
    assert "Aiden" in resp.json()["error"]["message"]


async def test_streamed_answer_over_tcp_with_the_openai_client(serve: httpx.AsyncClient, whole: Whole) -> None:
    app = serve._transport.app  # type: ignore[attr-defined]
    async with (
        served_over_tcp(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=USER,  # type: ignore[arg-type]
            modalities=["text", "audio"],
            max_tokens=16,
            temperature=0,
            seed=5,
            stream=True,
        )
        text, pcm = "", b""
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta.model_dump()
            text += delta.get("content") or ""
            pcm += base64.b64decode((delta.get("audio") or {}).get("data") or "")
    whole_text, waveform = whole.generate(USER, speaker="Ethan", max_tokens=16, seed=5)
    assert text == whole_text
    samples = np.frombuffer(pcm, dtype="<i2")
    reference = np.frombuffer(wav_bytes(waveform, 24000)[44:], dtype="<i2")
    # 24 codes in chunks of 12, joined without a gap: the whole waveform within the stated tolerance.
    assert samples.size == reference.size
    assert int(np.abs(samples.astype(np.int32) - reference).max()) <= STREAM_TOLERANCE_LSB


async def test_text_only_chat_never_reaches_the_talker_or_code2wav(serve: httpx.AsyncClient) -> None:
    before = (await serve.get("/metrics")).text
    resp = await serve.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 8})
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"]
    assert resp.json()["choices"][0]["message"]["audio"] is None
    after = (await serve.get("/metrics")).text
    assert stage_requests(after, "thinker") == stage_requests(before, "thinker") + 1
    for stage in ("talker", "code2wav"):
        assert stage_requests(after, stage) == stage_requests(before, stage)


async def test_the_tiny_model_is_byte_identical_per_seed(tmp_path: Path, tiny: Path) -> None:
    from omnimodel_runtime.tiny import build_tiny

    again = build_tiny(MODEL, tmp_path / "again", seed=0)
    other = build_tiny(MODEL, tmp_path / "other", seed=1)
    weights = "model.safetensors"
    assert (again / weights).read_bytes() == (tiny / weights).read_bytes() != (other / weights).read_bytes()
