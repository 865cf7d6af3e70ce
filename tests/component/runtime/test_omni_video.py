"""Video input to Qwen2.5-Omni chat: ``video_url`` parts (vLLM-Omni's shape, ``data:video/mp4;base64,...``)
on ``omnimodel serve --preset qwen2.5-omni`` as a real process, driven by the official ``openai`` client,
against the whole model's own ``generate()`` on the same frames through the same processor.

The video processor in the processor's slot is ours (transformers builds its own only with torchvision):
the first test checks it against transformers' own output on fixed inputs. Run this file as a script,
where torchvision imports, to compute that output again:
``python tests/component/runtime/test_omni_video.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from omni_helpers import QWEN25, Qwen25Whole, VideoInput, all_frames, audio_track, mp4_file, spoken_chat, video_part
from runtime_procs import RuntimeProcess, openai_client, running, runtime_env, serve_process, wav_of

pytestmark = [pytest.mark.engine]

MODEL = QWEN25
# The serve process runs its engines on one thread each, and the whole model runs on one too: the same
# float reductions in the same order, so the same bits.
THREADS = 1
QUESTION = "Describe it."

# ---------------------------------------------------------------- the video processor against transformers'

# name -> (frames, height, width, size given to the call (None: the checkpoint's), cap_pixels_per_frame,
# max_video_tokens (None: the default)). Noise frames from a seeded generator: the same bytes everywhere.
PROCESSOR_CASES: dict[str, tuple[int, int, int, dict[str, int] | None, bool, int | None]] = {
    # The Omni processor's sizes (it passes them on every call): 48 x 64 is upscaled to 280 x 392.
    "omni-sizes": (4, 48, 64, {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}, True, None),
    # Odd sizes shrunk to the pixel bound; an odd frame count padded with the last frame.
    "shrunk-odd-frames": (5, 37, 61, {"shortest_edge": 784, "longest_edge": 1568}, True, None),
    "enlarged": (4, 20, 30, {"shortest_edge": 3136, "longest_edge": 6272}, False, None),
    # Already a multiple of 28 within the bounds: no resize at all.
    "unresized": (2, 56, 84, None, True, None),
    # qwen-vl-utils' pixel budget for the whole video binds (few tokens allowed)...
    "capped": (6, 50, 90, None, True, 16),
    # ... and is ignored without the cap.
    "uncapped": (6, 50, 90, None, False, 16),
}
# transformers 5.19.0's Qwen2VLVideoProcessor (torchvision 0.28.0, torch 2.13.0+cpu) on those inputs:
# video_grid_thw and the sha256 of pixel_values_videos (float32, little-endian).
EXPECTED: dict[str, tuple[list[int], str]] = {
    "capped": ([3, 2, 4], "cd89fdb5cb423a09c0744e81c3cc69467b94dacb8a4eb45e8dc0826514fc1bbf"),
    "enlarged": ([2, 4, 6], "34e3669d130fcf78a569812e82f6d4faf102f594100261b95b12349d7175e1f2"),
    "omni-sizes": ([2, 20, 28], "b4035daf56abe8002e251b170e779202947c143d03248990924877a8b443fda3"),
    "shrunk-odd-frames": ([3, 2, 4], "a610cf0d0abf5c97707832ce810fcbf5d9c771ec457f71dd4ad08300df217252"),
    "uncapped": ([3, 4, 6], "c9de31bb3db7b5238de9f44207e6bb27acbf2473d4022c2c7b2340034d7b10dc"),
    "unresized": ([1, 4, 6], "299ce1236000c41bf8497393c953779aa298c86ad16ecfb4e7192d070418cf8d"),
}


def processor_frames(name: str) -> np.ndarray:
    count, height, width, *_ = PROCESSOR_CASES[name]
    seed = sorted(PROCESSOR_CASES).index(name)
    return (np.random.default_rng(seed).random((count, height, width, 3)) * 255).astype(np.uint8)


def processor_output(processor: Any, name: str) -> tuple[list[int], str]:
    _, _, _, size, cap, _ = PROCESSOR_CASES[name]
    extra = {} if size is None else {"size": size}
    out = processor(videos=[processor_frames(name)], return_tensors="pt", cap_pixels_per_frame=cap, **extra)
    pixels = out["pixel_values_videos"].numpy().astype("<f4")
    (grid,) = out["video_grid_thw"].tolist()
    return grid, hashlib.sha256(pixels.tobytes()).hexdigest()


def settings_of(model_dir: Path) -> dict[str, Any]:
    settings: dict[str, Any] = json.loads((model_dir / "preprocessor_config.json").read_text())
    return settings


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PROCESSOR_CASES))
def test_the_video_processor_gives_transformers_own_patches(name: str, tiny_omni: Path) -> None:
    from omnimodel_runtime.engines.omni.video import VideoProcessor

    tokens = PROCESSOR_CASES[name][5]
    settings = settings_of(tiny_omni) | ({} if tokens is None else {"max_video_tokens": tokens})
    assert processor_output(VideoProcessor(settings), name) == tuple(EXPECTED[name])


def test_frames_are_taken_two_a_second_evenly_spaced() -> None:
    """qwen-omni-utils' rule: 2 frames a second, a multiple of 2, at least 4 (and at most the video's)."""
    from omnimodel_runtime.engines.omni.video import frame_indices

    def taken(total: int, fps: float, num_frames: int | None = None) -> list[int]:
        out = frame_indices(total, fps, num_frames=num_frames, min_frames=4, max_frames=768, factor=2)
        return [int(i) for i in out]

    assert taken(4, 2.0) == [0, 1, 2, 3]  # 2 s at 2 fps: every frame
    assert taken(20, 10.0) == [0, 6, 13, 19]  # 2 s: 4 frames
    assert taken(45, 10.0) == [0, 6, 13, 19, 25, 31, 38, 44]  # 4.5 s: 9 frames, down to 8
    assert taken(3, 30.0) == [0, 2]  # a tenth of a second: the minimum of 4 is more than there are
    assert len(taken(300, 30.0)) == 20
    assert taken(45, 10.0, num_frames=6) == [0, 9, 18, 26, 35, 44]  # video_url.num_frames
    assert taken(45, 10.0, num_frames=100) == taken(45, 10.0, num_frames=44)


# ---------------------------------------------------------------- the served model


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_omni: Path) -> Iterator[RuntimeProcess]:
    """``omnimodel serve --preset qwen2.5-omni --model tiny://qwen2.5-omni`` as a process."""
    env = runtime_env(model_cache, OMNIMODEL_DEVICE="cpu", OMP_NUM_THREADS=THREADS)
    proc = serve_process(MODEL, tmp_path_factory.mktemp("omni-video"), env)
    with running(proc):
        yield proc.wait_healthy(timeout=240)


@pytest.fixture(scope="module")
def client(serve: RuntimeProcess) -> openai.OpenAI:
    return openai_client(serve.url, timeout=180)


def post(serve: RuntimeProcess, content: list[dict[str, Any]], **body: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **body}
    return httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=180)


@pytest.mark.slow
def test_video_chat_answers_as_the_whole_model_does(client: openai.OpenAI, whole_omni: Qwen25Whole) -> None:
    """A video in, text and audio out, with the official client: the whole model's text and waveform.
    The thinker's answer depends on the video's M-RoPE time positions (seconds per temporal patch); the
    tiny talker's codes do not depend on its own (a bogus grid gives the same codes), so a wrong grid or
    rate handed to the talker would go unseen here: the prompt frame carries the whole model's values."""
    video = mp4_file(2)  # 2 s at 2 fps: its 4 frames are the ones taken
    content: Any = [{"type": "text", "text": QUESTION}, video_part(video)]
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(**spoken_chat(messages, voice="Ethan", max_tokens=12, seed=9))
    message = reply.choices[0].message
    assert message.audio is not None
    frames = VideoInput(all_frames(video), 2.0)
    text, wav = whole_omni.generate_content(
        content, speaker="Ethan", max_tokens=12, seed=9, threads=THREADS, video=frames
    )
    assert (message.content, message.audio.transcript) == (text, text)
    assert wav_of(message.model_dump()) == wav
    # Text only: the thinker alone, the same answer.
    alone = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0
    )
    assert alone.choices[0].message.content == text


@pytest.mark.slow
def test_the_video_audio_track_goes_in_with_use_audio_in_video(client: openai.OpenAI, whole_omni: Qwen25Whole) -> None:
    """vLLM-Omni's ``mm_processor_kwargs.use_audio_in_video``: the track is decoded and interleaved with
    the frames (2-second chunks), as the whole model takes it with the same flag."""
    video = mp4_file(2, audio=True, seed=1)
    content: Any = [{"type": "text", "text": QUESTION}, video_part(video)]
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(
        **spoken_chat(messages, voice="Chelsie", max_tokens=10, seed=4),
        extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}},
    )
    message = reply.choices[0].message
    assert message.audio is not None
    track = audio_track(video)
    with_track = VideoInput(all_frames(video), 2.0, audio=track)
    text, wav = whole_omni.generate_content(
        content, speaker="Chelsie", max_tokens=10, seed=4, threads=THREADS, video=with_track
    )
    assert message.content == text
    assert wav_of(message.model_dump()) == wav
    without = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=1)
    assert reply.usage is not None
    assert without.usage is not None
    # The track's tokens (25 a second: 100 mel frames, pooled 4x; the AAC encoder's priming makes its 2 s
    # 2.1 s) and the audio markers around them.
    mel_frames = math.ceil(track.size / 160)
    assert reply.usage.prompt_tokens - without.usage.prompt_tokens == ((mel_frames - 1) // 2 + 1 - 2) // 2 + 1 + 2


def prompt_tokens(serve: RuntimeProcess, content: list[dict[str, Any]]) -> int:
    resp = post(serve, content)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


@pytest.mark.slow
def test_prompt_tokens_grow_with_the_frames(serve: RuntimeProcess) -> None:
    """48 x 64 frames become 280 x 392 (the processor's minimum of 128 x 28 x 28 pixels): 20 x 28 patches,
    merged 2 x 2 into 140 tokens per temporal patch of 2 frames."""
    two, four = (prompt_tokens(serve, [video_part(mp4_file(s))]) for s in (2, 4))
    assert four - two == 140 * 2
    assert prompt_tokens(serve, [video_part(mp4_file(4), num_frames=6)]) - two == 140
    # 30 frames a second are sampled down to 2 a second: the same 4 frames' worth of tokens.
    assert prompt_tokens(serve, [video_part(mp4_file(2, fps=30))]) == two


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_video_that_does_not_decode_is_a_400_naming_its_part(serve: RuntimeProcess, stream: bool) -> None:
    cases: list[tuple[list[dict[str, Any]], Mapping[str, Any], str, str]] = [
        ([video_part(b"this is not a video")], {}, "messages[0].content[1]", "cannot decode the video"),
        (
            [video_part(mp4_file(2))],
            {"mm_processor_kwargs": {"use_audio_in_video": True}},
            "messages[0].content[1]",
            "no audio track",
        ),
        ([video_part(mp4_file(2)), video_part(mp4_file(2))], {}, "messages[0].content[2]", "one video per request"),
    ]
    for parts, extra, param, what in cases:
        content = [{"type": "text", "text": QUESTION}, *parts]
        resp = post(serve, content, stream=stream, modalities=["text", "audio"], **extra)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
        assert what in resp.json()["error"]["message"]


if __name__ == "__main__":
    # Transformers' own video processor on the cases (needs torchvision): the EXPECTED table above.
    import sys

    from transformers import Qwen2VLVideoProcessor

    from omnimodel_runtime.tiny import ensure_tiny

    model_dir = ensure_tiny(MODEL, Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".cache/models"))
    table = {}
    for case in sorted(PROCESSOR_CASES):
        tokens = PROCESSOR_CASES[case][5]
        reference = Qwen2VLVideoProcessor.from_pretrained(
            model_dir, **({} if tokens is None else {"max_video_tokens": tokens})
        )
        table[case] = processor_output(reference, case)
    print(json.dumps(table, indent=4))
