"""The torch-free parts of the TTS stages: the streaming time-stretch, the vocoder's chunk plan, the
HiFi-GAN receptive field, voices and generation bounds from a model directory, and the audio encoders."""

from __future__ import annotations

import io
import itertools
import json
import wave
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import given, settings
from hypothesis import strategies as st

from omnimodel_runtime.engines.audio import TimeStretch
from omnimodel_runtime.engines.tts.common import (
    ChunkPlan,
    GenerationBounds,
    hifigan_context_frames,
    load_voices,
    stage_dir,
)
from omnimodel_runtime.errors import RuntimeSetupError
from omnimodel_runtime.serving.audio import Resampler, encode_audio, resample, to_pcm16, unsupported_reason

# microsoft/speecht5_hifigan's configuration.
RELEASED_HIFIGAN = {
    "upsample_rates": [4, 4, 4, 4],
    "upsample_kernel_sizes": [8, 8, 8, 8],
    "resblock_kernel_sizes": [3, 7, 11],
    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
}


def _split(n: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Cut ``range(n)`` into consecutive pieces of the given sizes (cycled)."""
    out, start, k = [], 0, 0
    while start < n:
        end = min(n, start + sizes[k % len(sizes)])
        out.append((start, end))
        start, k = end, k + 1
    return out


@settings(max_examples=60, deadline=None)
@given(
    speed=st.sampled_from([0.25, 0.3, 0.5, 0.8, 1.0, 1.25, 2.0, 3.3, 4.0]),
    frames=st.integers(1, 120),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5),
)
def test_streamed_time_stretch_equals_the_stretch_of_the_whole_utterance(
    speed: float, frames: int, sizes: list[int]
) -> None:
    mel = np.random.default_rng(frames).standard_normal((frames, 5)).astype(np.float32)
    whole = TimeStretch(speed).push(mel, final=True)
    stretch = TimeStretch(speed)
    pieces = [stretch.push(mel[a:b], final=b == frames) for a, b in _split(frames, sizes)]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    # Duration scales by 1/speed (within a frame).
    assert len(whole) == int(np.floor((frames - 1) / speed)) + 1


def test_time_stretch_interpolates_between_neighbouring_frames() -> None:
    mel = np.array([[0.0], [10.0], [20.0]], dtype=np.float32)
    np.testing.assert_allclose(TimeStretch(0.5).push(mel, final=True)[:, 0], [0, 5, 10, 15, 20])
    np.testing.assert_allclose(TimeStretch(2.0).push(mel, final=True)[:, 0], [0, 20])
    assert TimeStretch(1.0).push(mel) is not None
    with pytest.raises(ValueError, match="speed"):
        TimeStretch(5.0)


def _fake_vocoder(reach: int, hop: int, weights: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A convolution over frames (zero-padded at the edges like HiFi-GAN's), each frame -> hop samples."""

    def run(mel: np.ndarray) -> np.ndarray:
        padded = np.pad(mel, (reach, reach))
        out = np.array([float(padded[i : i + 2 * reach + 1] @ weights) for i in range(len(mel))])
        return np.repeat(out, hop)

    return run


@pytest.mark.parametrize(("first", "largest"), [(1, 1), (3, 12), (16, 128)])
def test_chunked_vocoding_with_context_joins_without_seams(first: int, largest: int) -> None:
    reach, hop = 5, 3
    weights = np.random.default_rng(0).standard_normal(2 * reach + 1)
    vocode = _fake_vocoder(reach, hop, weights)
    mel = np.random.default_rng(1).standard_normal(70)
    whole = vocode(mel)
    plan = ChunkPlan(first=first, largest=largest, context=reach)
    pieces, kept = [], []
    # Frames arrive two at a time, as the acoustic stage emits them; then the stream ends.
    for available in [*range(2, len(mel) + 1, 2), len(mel)]:
        finished = available == len(mel)
        while (w := plan.next(available, finished=finished)) is not None:
            assert w.hi <= available
            out = vocode(mel[w.lo : w.hi])
            pieces.append(out[(w.start - w.lo) * hop : (w.end - w.lo) * hop])
            kept.append((w.start, w.end))
    # The first chunk goes as soon as `first` frames are ready (frames arrive two at a time).
    assert kept[0][0] == 0
    assert first <= kept[0][1] <= first + 1
    assert all(a[1] == b[0] for a, b in itertools.pairwise(kept))
    assert kept[-1][1] == len(mel)
    assert max(e - s for s, e in kept) <= largest
    np.testing.assert_allclose(np.concatenate(pieces), whole, rtol=0, atol=1e-12)


def test_a_chunk_waits_for_its_right_context_until_the_stream_ends() -> None:
    plan = ChunkPlan(first=4, largest=8, context=3)
    assert plan.next(6, finished=False) is None  # 6 - 3 = 3 ready frames < 4
    window = plan.next(7, finished=False)
    assert window is not None
    assert (window.lo, window.start, window.end, window.hi) == (0, 0, 4, 7)
    assert plan.next(8, finished=False) is None  # the next chunk wants 8 frames
    last = plan.next(9, finished=True)
    assert last is not None
    assert (last.lo, last.start, last.end, last.hi) == (1, 4, 9, 9)
    assert plan.next(9, finished=True) is None


def test_hifigan_context_covers_the_released_vocoders_receptive_field() -> None:
    # Measured with an impulse through SpeechT5HifiGan (tests/component/runtime/test_tts_engines.py): 24.
    assert hifigan_context_frames(**RELEASED_HIFIGAN) == 26


def test_voices_come_from_npy_files_and_default_always_exists(tmp_path: Path) -> None:
    (tmp_path / "voices").mkdir()
    np.save(tmp_path / "voices" / "alto.npy", np.ones(4, dtype=np.float32))
    np.save(tmp_path / "voices" / "bad name!.npy", np.ones(4, dtype=np.float32))
    voices = load_voices(tmp_path / "voices", 4)
    assert sorted(voices) == ["alto", "default"]
    np.testing.assert_array_equal(voices["default"], np.zeros(4, dtype=np.float32))
    assert sorted(load_voices(tmp_path / "missing", 4)) == ["default"]
    np.save(tmp_path / "voices" / "wide.npy", np.ones(5, dtype=np.float32))
    with pytest.raises(RuntimeSetupError, match=r"wide\.npy has 5 values; the acoustic model needs 4"):
        load_voices(tmp_path / "voices", 4)


def test_generation_bounds_from_speech_json_and_engine_args(tmp_path: Path) -> None:
    assert GenerationBounds.load(tmp_path, {}) == GenerationBounds(0.5, 0.0, 20.0)
    (tmp_path / "speech.json").write_text(json.dumps({"maxlenratio": 4.0, "threshold": 0.7}))
    assert GenerationBounds.load(tmp_path, {"threshold": 0.9}) == GenerationBounds(0.9, 0.0, 4.0)
    with pytest.raises(RuntimeSetupError, match="minlenratio <= maxlenratio"):
        GenerationBounds.load(tmp_path, {"minlenratio": 5})


def test_stage_dir_prefers_the_stage_subdirectory_then_the_model_root(tmp_path: Path) -> None:
    assert stage_dir(tmp_path, {}, "acoustic") == tmp_path
    (tmp_path / "acoustic").mkdir()
    (tmp_path / "acoustic" / "config.json").write_text("{}")
    assert stage_dir(tmp_path, {}, "acoustic") == tmp_path / "acoustic"
    assert stage_dir(tmp_path, {"path": "elsewhere"}, "acoustic") == tmp_path / "elsewhere"
    assert stage_dir(tmp_path, {"path": "/abs"}, "acoustic") == Path("/abs")


WAVE = (0.5 * np.sin(np.arange(8000) / 7)).astype(np.float32)


def test_wav_keeps_the_models_rate_and_pcm_is_the_same_audio_at_24_khz() -> None:
    with wave.open(io.BytesIO(encode_audio(WAVE, 16000, "wav"))) as wav:
        assert wav.getframerate() == 16000
        frames = wav.readframes(wav.getnframes())
    assert frames == to_pcm16(WAVE)
    assert encode_audio(WAVE, 16000, "pcm") == to_pcm16(resample(WAVE, 16000, 24000))
    assert len(encode_audio(WAVE, 16000, "pcm")) == 2 * len(WAVE) * 3 // 2
    # A model that speaks at 24 kHz (Qwen-Omni) gets its own samples.
    assert encode_audio(WAVE, 24000, "pcm") == to_pcm16(WAVE)


@pytest.mark.parametrize("source", [8000, 16000, 22050, 44100, 48000])
def test_resampling_keeps_a_tone_and_the_duration(source: int) -> None:
    seconds = np.arange(source) / source
    tone = (0.5 * np.sin(2 * np.pi * 440 * seconds)).astype(np.float32)
    out = resample(tone, source, 24000)
    assert len(out) == 24000
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(24000) / 24000)
    # Away from the edges (where the filter sees the silence around the input), within -80 dB of the tone.
    assert np.abs(out[100:-100] - expected[100:-100]).max() < 1e-4


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=20))
def test_a_resampled_stream_equals_the_whole_bit_for_bit(cuts: list[int]) -> None:
    resampler = Resampler(16000, 24000)
    pieces = [resampler.push(WAVE[start:end]) for start, end in _split(len(WAVE), cuts)]
    pieces.append(resampler.flush())
    np.testing.assert_array_equal(np.concatenate(pieces), resample(WAVE, 16000, 24000))


@pytest.mark.parametrize(("fmt", "magic"), [("flac", b"fLaC"), ("mp3", None), ("opus", b"OggS")])
def test_libsndfile_formats_decode_at_the_stated_rate(fmt: str, magic: bytes | None) -> None:
    assert unsupported_reason(fmt) is None
    data = encode_audio(WAVE, 16000, fmt)
    if magic is not None:
        assert data.startswith(magic)
    decoded, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 16000
    # Lossy codecs add encoder delay/padding; the duration stays within 100 ms.
    assert abs(len(decoded) - len(WAVE)) < 1600
    if fmt == "flac":
        lossless, _ = sf.read(io.BytesIO(data), dtype="int16")
        assert lossless.astype("<i2").tobytes() == to_pcm16(WAVE)


def test_formats_without_an_encoder_are_refused_by_name() -> None:
    assert unsupported_reason("wav") is None
    reason = unsupported_reason("aac")
    assert reason is not None
    assert "'aac' is not supported" in reason
    with pytest.raises(ValueError, match="'aac'"):
        encode_audio(WAVE, 16000, "aac")
    if unsupported_reason("opus") is None:
        with pytest.raises(ValueError, match="opus cannot encode 22050 Hz"):
            encode_audio(WAVE, 22050, "opus")
