"""Helpers for the Qwen-Omni component tests: the whole (unsplit) model a split pipeline is compared against,
the media a client sends, the requests they share, and code2wav driven directly.

A plain module (not conftest) so test files can import it by its unique name.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import warnings
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from runtime_procs import metric_total, random_png, streamed_audio, streamed_text, torch_threads

from omnimodel_runtime.serving.audio import wav_bytes

QWEN25 = "qwen2.5-omni"
QWEN3 = "qwen3-omni"
USER = [{"role": "user", "content": "Hello there, who are you and what can you do?"}]
# Max abs difference between chunked and single-pass code2wav audio from the same noise (measured: ~2e-7).
CHUNKED_TOLERANCE = 1e-5
# Qwen3-Omni's streamed audio (code2wav in chunks of 12 codes with left context and one code of look-ahead)
# vs the whole model's (one vocoder pass over every code), in 16-bit PCM steps.
QWEN3_STREAM_TOLERANCE_LSB = 1
# The audio track of the MP4 files built here (the Omni feature extractors' rate: no resampling).
VIDEO_AUDIO_RATE = 16000
# The marks of a Qwen3-Omni test module (its ``pytestmark``).
QWEN3_MARKS = [
    pytest.mark.engine,
    pytest.mark.asyncio(loop_scope="module"),
    # The whole model's talker generate() warns that its repetition penalty skips the prompt (by design).
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`:UserWarning"),
]


# The prompts the batched tests send one at a time, then together.
BATCH_PROMPTS = ["Hello there, who are you?", "What is a pod?", "Tell me about the cluster.", "Why do engines batch?"]


def batched_steps(metrics: str, stage: str) -> float:
    """Steps of ``stage`` that served more than one request (from the batch-size histogram)."""
    total = metric_total(metrics, "omnimodel_batch_size_count", {"stage": stage})
    return total - metric_total(metrics, "omnimodel_batch_size_bucket", {"stage": stage, "le": "1.0"})


def chat_body(model: str, prompt: str, *, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy chat request with text and audio out (seed 5), as the batched tests send it."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 5,
        **extra,
    }


@dataclass
class AloneAndTogether:
    """The answers to the same requests sent one at a time and then all at once, and ``/metrics`` before and
    after the concurrent round."""

    alone: list[dict[str, Any]]
    together: list[dict[str, Any]]
    before: str
    after: str

    def shared_steps(self, stage: str) -> bool:
        """Whether ``stage`` ran steps of several requests during the concurrent round."""
        return batched_steps(self.after, stage) > batched_steps(self.before, stage)


async def alone_and_together(http: Any, bodies: Sequence[Mapping[str, Any]]) -> AloneAndTogether:
    """Each chat request of ``bodies`` alone, then all at once, through ``http`` (an ``httpx.AsyncClient``)."""

    async def message(resp: Any) -> dict[str, Any]:
        assert resp.status_code == 200, resp.text
        answer: dict[str, Any] = resp.json()["choices"][0]["message"]
        return answer

    alone = [await message(await http.post("/v1/chat/completions", json=b)) for b in bodies]
    before = (await http.get("/metrics")).text
    resps = await asyncio.gather(*(http.post("/v1/chat/completions", json=b) for b in bodies))
    after = (await http.get("/metrics")).text
    return AloneAndTogether(alone, [await message(r) for r in resps], before, after)


def spoken_chat(
    messages: Sequence[Mapping[str, Any]], *, voice: str, max_tokens: int, seed: int, model: str = QWEN25
) -> dict[str, Any]:
    """The arguments of the ``openai`` client's ``chat.completions.create`` for a greedy spoken answer."""
    return {
        "model": model,
        "messages": messages,
        "modalities": ["text", "audio"],
        "audio": {"voice": voice, "format": "wav"},
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": seed,
    }


def long_spoken_stream(max_tokens: int) -> dict[str, Any]:
    """A streamed spoken chat of :data:`USER` that goes on for ``max_tokens`` thinker tokens."""
    return {
        "model": QWEN25,
        "messages": USER,
        "modalities": ["text", "audio"],
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }


def assert_qwen3_stream_matches(chunks: Sequence[Mapping[str, Any]], text: str, wav: bytes) -> None:
    """A streamed Qwen3-Omni answer's ``chunks`` against the whole model's ``text`` and ``wav``: the same
    text, and as many samples, each within :data:`QWEN3_STREAM_TOLERANCE_LSB`."""
    assert streamed_text(chunks) == text
    samples = np.frombuffer(b"".join(streamed_audio(chunks)), dtype="<i2")
    reference = np.frombuffer(wav[44:], dtype="<i2")
    assert samples.size == reference.size
    assert int(np.abs(samples.astype(np.int32) - reference).max()) <= QWEN3_STREAM_TOLERANCE_LSB


# ----------------------------------------------------------------------------- media a client sends


def wav_file(seconds: float, rate: int = 16000, seed: int = 3) -> bytes:
    """A WAV file (16-bit PCM) of noise at ``rate``."""
    import soundfile

    samples = (np.random.default_rng(seed).standard_normal(int(seconds * rate)) * 0.1).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def png_file(height: int = 56, width: int = 84, seed: int = 4) -> bytes:
    return random_png(width, height, seed)


def audio_part(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def video_part(data: bytes, **extra: Any) -> dict[str, Any]:
    """A ``video_url`` part (vLLM-Omni's shape): ``data`` as an MP4 data URL, with ``extra`` (``num_frames``)."""
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return {"type": "video_url", "video_url": {"url": url, **extra}}


def mp4_file(
    seconds: float, fps: int = 2, *, height: int = 48, width: int = 64, seed: int = 0, audio: bool = False
) -> bytes:
    """An MP4 file of noise frames (MPEG-4 part 2, which every FFmpeg build encodes), with a mono 16 kHz
    AAC track of noise when ``audio``."""
    import av

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        track = container.add_stream("aac", rate=VIDEO_AUDIO_RATE, layout="mono") if audio else None
        for _ in range(round(seconds * fps)):
            frame = av.VideoFrame.from_ndarray((rng.random((height, width, 3)) * 255).astype(np.uint8), format="rgb24")
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if track is not None:
            samples = (rng.standard_normal((1, round(seconds * VIDEO_AUDIO_RATE))) * 0.1).astype(np.float32)
            for start in range(0, samples.shape[1], 1024):
                chunk = av.AudioFrame.from_ndarray(
                    samples[:, start : start + 1024].copy(), format="fltp", layout="mono"
                )
                chunk.sample_rate = VIDEO_AUDIO_RATE
                container.mux(track.encode(chunk))
            container.mux(track.encode(None))
    return out.getvalue()


def all_frames(data: bytes) -> np.ndarray:
    """Every frame of the file as RGB, as a client library decodes it (PyAV)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])


def audio_track(data: bytes) -> np.ndarray:
    """The file's audio track (mono, at its own 16 kHz), as a client library decodes it (PyAV)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(container.streams.audio[0]))
    assert {f.sample_rate for f in frames} == {VIDEO_AUDIO_RATE}
    return np.concatenate([f.to_ndarray() for f in frames], axis=1)[0]


@dataclass(frozen=True)
class VideoInput:
    """A video as the whole model gets it: its frames (all of them, as sampled), their rate, and its audio
    track (16 kHz mono) to interleave with them (``use_audio_in_video``) or None."""

    frames: np.ndarray
    fps: float
    audio: np.ndarray | None = None


# ------------------------------------------------------------------------------------ the whole model


@dataclass
class Whole:
    """The unsplit model (``Whole.MODEL_CLASS`` of transformers) loaded from the same checkpoint."""

    MODEL_CLASS: ClassVar[str]
    model_dir: Path

    @cached_property
    def model(self) -> Any:
        import transformers

        return getattr(transformers, self.MODEL_CLASS).from_pretrained(self.model_dir).eval()

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def eos_ids(self) -> dict[str, Any]:
        """The end-of-sequence ids ``generate()`` needs: its defaults are the released vocabulary's."""
        raise NotImplementedError

    def generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        speaker: str,
        max_tokens: int,
        seed: int,
        threads: int | None = None,
    ) -> tuple[str, bytes]:
        """The whole model's text and its waveform as the WAV file a client would get. ``threads``: the
        torch thread count of the stages compared against (CPU kernels sum in an order that depends on
        it, so bit-equality needs the same count)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        return self.speak(inputs, speaker=speaker, max_tokens=max_tokens, seed=seed, threads=threads)

    def speak(
        self, inputs: Any, *, speaker: str, max_tokens: int, seed: int, threads: int | None, **options: Any
    ) -> tuple[str, bytes]:
        """The whole model's greedy text and WAV for its processed ``inputs`` (``options``: more arguments
        of its ``generate()``)."""
        import torch

        generation = json.loads((self.model_dir / "omni_generation_config.json").read_text())["talker"]
        model, eos_ids = self.model, self.eos_ids()  # loaded before the seed: generate() alone draws from it
        with torch_threads(threads):
            torch.manual_seed(seed)
            sequences, waveform = model.generate(
                **inputs,
                **options,
                speaker=speaker,
                thinker_max_new_tokens=max_tokens,
                thinker_do_sample=False,
                talker_max_new_tokens=generation["max_new_tokens"],
                **eos_ids,
            )
        return self.reply(sequences, inputs), wav_bytes(waveform.reshape(-1).numpy(), 24000)

    def reply(self, sequences: Any, inputs: Any) -> str:
        return str(self.tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))

    def processor(self) -> Any:
        """The checkpoint's processor, as the thinker stage loads it."""
        from omnimodel_runtime.engines.omni.inputs import load_processor

        return load_processor(self.model_dir)

    def processed(self, content: Sequence[Mapping[str, Any]], video: VideoInput | None = None) -> Any:
        """The processor's inputs for one user message of OpenAI ``content`` parts, its media decoded as a
        client library would (libsndfile, Pillow; the frames of a ``video_url`` part are ``video``'s), in
        Hugging Face's own chat format."""
        import soundfile
        from PIL import Image

        from omnimodel_runtime.engines.omni.inputs import audio_in_video_kwargs

        processor = self.processor()
        parts: list[Mapping[str, Any]] = []
        audio: list[np.ndarray] = []
        sources: list[int | None] = []  # per audio input: None, or 0 for the video's track
        images: list[Any] = []
        for part in content:
            if part["type"] == "input_audio":
                samples, rate = soundfile.read(
                    io.BytesIO(base64.b64decode(part["input_audio"]["data"])), dtype="float32"
                )
                assert rate == processor.feature_extractor.sampling_rate
                audio.append(samples)
                sources.append(None)
                parts.append({"type": "audio", "audio": samples})
            elif part["type"] == "image_url":
                data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
                images.append(Image.open(io.BytesIO(data)).convert("RGB"))
                parts.append({"type": "image", "image": images[-1]})
            elif part["type"] == "video_url":
                assert video is not None
                if video.audio is not None:
                    audio.append(video.audio)  # in the video's place: the processor reads them in text order
                    sources.append(0)
                parts.append({"type": "video", "video": "frames"})
            else:
                parts.append(part)
        text = processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        videos: dict[str, Any] = {}
        if video is not None:
            videos = {"videos": [video.frames], "fps": video.fps, "cap_pixels_per_frame": True}
            if video.audio is not None:
                # The argument's name and form depend on the transformers release.
                videos.update(audio_in_video_kwargs(processor, sources))
        with warnings.catch_warnings():
            # transformers 5.19 interleaves a video's audio with np.arange(a torch scalar), which numpy 2
            # reports as deprecated; the stage under test runs the same line.
            warnings.filterwarnings("ignore", "__array__ implementation", DeprecationWarning)
            return processor(text=[text], audio=audio or None, images=images or None, return_tensors="pt", **videos)


class Qwen25Whole(Whole):
    """``Qwen2_5OmniForConditionalGeneration``, and its answer to audio, image and video input."""

    MODEL_CLASS = "Qwen2_5OmniForConditionalGeneration"

    def eos_ids(self) -> dict[str, Any]:
        talker = self.model.talker
        return {"talker_eos_token_id": [talker.codec_pad_token, talker.codec_eos_token]}

    def generate_content(
        self,
        content: Sequence[Mapping[str, Any]],
        *,
        speaker: str,
        max_tokens: int,
        seed: int,
        threads: int | None = None,
        speech: bool = True,
        video: VideoInput | None = None,
    ) -> tuple[str, bytes | None]:
        """The whole model's text and WAV (``speech=False``: text only, no WAV) for one user message of
        OpenAI ``content`` parts (:meth:`processed`; ``video``: the frames of its ``video_url`` part)."""
        import torch

        with torch_threads(threads):
            inputs = self.processed(content, video)
            with_audio = {"use_audio_in_video": video is not None and video.audio is not None}
            if not speech:
                model = self.model
                torch.manual_seed(seed)
                sequences = model.generate(
                    **inputs,
                    **with_audio,
                    thinker_max_new_tokens=max_tokens,
                    thinker_do_sample=False,
                    generation_mode="text",
                )
                return self.reply(sequences, inputs), None
            # transformers 5.19's whole generate() hands the image's and video's pixels to the talker too,
            # whose generate() refuses them ("model_kwargs are not used"): the talker reads only their grids.
            talker = self.model.talker
            talker_generate = talker.generate

            def without_pixels(*args: Any, **kwargs: Any) -> Any:
                kwargs.pop("pixel_values", None)
                kwargs.pop("pixel_values_videos", None)
                return talker_generate(*args, **kwargs)

            talker.generate = without_pixels
            try:
                return self.speak(
                    inputs, speaker=speaker, max_tokens=max_tokens, seed=seed, threads=threads, **with_audio
                )
            finally:
                del talker.generate


class Qwen3Whole(Whole):
    """``Qwen3OmniMoeForConditionalGeneration``, and its answer to audio, image and video input."""

    MODEL_CLASS = "Qwen3OmniMoeForConditionalGeneration"

    @cached_property
    def model(self) -> Any:
        from transformers import Qwen3OmniMoeForConditionalGeneration

        from omnimodel_runtime.engines.omni.qwen3 import lend_audio_config

        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(self.model_dir).eval()
        # transformers 5.19's whole generate() fails on audio with an image or a video (its talker's config
        # has no audio_config): given the thinker's, as the talker stage is.
        lend_audio_config(model.talker, model.config)
        return model

    def eos_ids(self) -> dict[str, Any]:
        return {"thinker_eos_token_id": self.model.config.im_end_token_id}

    def processor(self) -> Any:
        from transformers import Qwen3OmniMoeProcessor

        from omnimodel_runtime.engines.omni.inputs import load_processor

        return load_processor(self.model_dir, Qwen3OmniMoeProcessor)

    def generate_content(
        self,
        content: Sequence[Mapping[str, Any]],
        *,
        speaker: str,
        max_tokens: int,
        seed: int,
        threads: int | None = None,
        video: VideoInput | None = None,
    ) -> tuple[str, bytes]:
        """The whole model's text and WAV for one user message of OpenAI ``content`` parts (:meth:`processed`;
        ``video``: the frames of its ``video_url`` part, and the track to interleave with them)."""
        with torch_threads(threads):
            inputs = self.processed(content, video)
        with_audio = {"use_audio_in_video": video is not None and video.audio is not None}
        return self.speak(inputs, speaker=speaker, max_tokens=max_tokens, seed=seed, threads=threads, **with_audio)


# ------------------------------------------------------------------------------ code2wav by itself


async def chunked_code2wav(engine: Any, codes: np.ndarray, *, seed: int, request_id: str) -> list[np.ndarray]:
    """The audio pieces code2wav's ``engine`` streams for ``codes`` trickling in five at a time, as the
    talker samples them (chunked, voice Chelsie)."""
    from omnimodel_runtime.engines.omni.common import CODES_KIND, tensor_frame
    from omnimodel_runtime.protocol.stage import (
        FinalFrame,
        SamplingParams,
        StageInput,
        StageParams,
        StageRequest,
        TensorFrame,
    )

    async def talker() -> AsyncIterator[Any]:
        for i in range(0, len(codes), 5):
            yield tensor_frame(CODES_KIND, {"codes": codes[i : i + 5]})
            await asyncio.sleep(0)  # a turn for the other streams of a batch
        yield FinalFrame("stop")

    request = StageRequest(
        request_id=request_id,
        prompt="",
        sampling=SamplingParams(seed=seed),
        params=StageParams(audio_chunked=True, voice="Chelsie"),
    )
    return [
        f.tensors["audio"]
        async for f in engine.generate(StageInput(request=request, upstream=talker()))
        if isinstance(f, TensorFrame)
    ]


def code2wav_one_pass(engine: Any, codes: np.ndarray, *, seed: int) -> np.ndarray:
    """code2wav's audio for all of ``codes`` in a single DiT and vocoder pass over the noise that ``seed``
    pages out (voice Chelsie)."""
    import torch

    from omnimodel_runtime.engines.omni.code2wav import PagedNoise, sample_mel

    dit, speaker = engine.model.code2wav_dit_model, engine.speakers["Chelsie"]
    frames = len(codes) * int(dit.repeats)
    noise = PagedNoise(seed, int(dit.config.block_size), int(dit.mel_dim), "cpu").frames(0, frames)
    with torch.inference_mode():
        mel = sample_mel(
            dit,
            speaker["cond"].float().reshape(1, -1),
            speaker["ref_mel"].float(),
            torch.from_numpy(codes).unsqueeze(0),
            noise,
        )
        return np.asarray(engine.model.code2wav_bigvgan_model(mel).reshape(-1).numpy())
