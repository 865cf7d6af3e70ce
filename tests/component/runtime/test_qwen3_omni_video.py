"""Video input to Qwen3-Omni chat: ``video_url`` parts (vLLM-Omni's shape, ``data:video/mp4;base64,...``)
on ``omnimodel serve``'s app (in process), with the official client, on the tiny random-weight model, against
the whole ``Qwen3OmniMoeForConditionalGeneration.generate()`` on the same frames through the same processor.

``Qwen3OmniMoeProcessor``'s video part is transformers' ``Qwen2VLVideoProcessor`` (as Qwen2.5-Omni's), so
the torch one in its slot is the one test_omni_video.py checks against transformers'; Qwen3 passes it other
sizes (32-pixel merged patches) and lays out the time positions itself (13 per second;
``use_audio_in_video`` interleaves the track by those positions). The talker reads the thinker's
layer-``accept_hidden_layer`` rows at the video placeholders and the video's grid and seconds per temporal
patch, so the split's waveform equals the whole model's only if all of them arrive exactly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from omni_helpers import (
    QWEN3,
    QWEN3_MARKS,
    Qwen3Whole,
    VideoInput,
    all_frames,
    audio_track,
    mp4_file,
    spoken_chat,
    video_part,
)
from runtime_procs import Served, serve_fixture, wav_of

pytestmark = [
    *QWEN3_MARKS,
    # transformers 5.19's Qwen3 processor interleaves a video's track with np.arange(a torch scalar), which
    # numpy 2 reports as deprecated; the thinker runs in this process here, so its warning reaches the test
    # (Python's default filters keep it out of a server's log).
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

MODEL = QWEN3
QUESTION = "Describe it."
USE_AUDIO_IN_VIDEO = {"mm_processor_kwargs": {"use_audio_in_video": True}}

serve = serve_fixture(MODEL, "tiny_qwen3")


async def spoken(serve: Served, content: list[dict[str, Any]], *, voice: str, seed: int, **extra: Any) -> Any:
    """The split stages' answer (text and WAV) to one user message, with the official client."""
    messages = [{"role": "user", "content": content}]
    return await serve.openai.chat.completions.create(
        **spoken_chat(messages, voice=voice, max_tokens=12, seed=seed, model=MODEL), extra_body=extra or None
    )


async def prompt_tokens(serve: Served, content: list[dict[str, Any]], **extra: Any) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}
    resp = await serve.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


@pytest.mark.slow
async def test_video_chat_answers_as_the_whole_model_does(serve: Served, whole_qwen3: Qwen3Whole) -> None:
    """A video in, text and audio out: the whole model's text and waveform. Another video gives another
    waveform (the talker does hear the video rows)."""
    video = mp4_file(2)  # 2 s at 2 fps: its 4 frames are the ones taken
    content: Any = [{"type": "text", "text": QUESTION}, video_part(video)]
    message = (await spoken(serve, content, voice="Ethan", seed=9)).choices[0].message
    assert message.audio is not None
    text, wav = whole_qwen3.generate_content(
        content, speaker="Ethan", max_tokens=12, seed=9, video=VideoInput(all_frames(video), 2.0)
    )
    assert (message.content, message.audio.transcript) == (text, text)
    assert wav_of(message.model_dump()) == wav
    other: Any = [{"type": "text", "text": QUESTION}, video_part(mp4_file(2, seed=5))]
    assert wav_of((await spoken(serve, other, voice="Ethan", seed=9)).choices[0].message.model_dump()) != wav


@pytest.mark.slow
async def test_the_video_audio_track_goes_in_with_use_audio_in_video(serve: Served, whole_qwen3: Qwen3Whole) -> None:
    """vLLM-Omni's ``mm_processor_kwargs.use_audio_in_video``: the track is decoded and interleaved with the
    frames by their time positions, as the whole model takes it with the same flag."""
    video = mp4_file(2, audio=True, seed=1)
    content: Any = [{"type": "text", "text": QUESTION}, video_part(video)]
    reply = await spoken(serve, content, voice="Chelsie", seed=4, **USE_AUDIO_IN_VIDEO)
    message = reply.choices[0].message
    assert message.audio is not None
    track = audio_track(video)
    with_track = VideoInput(all_frames(video), 2.0, audio=track)
    text, wav = whole_qwen3.generate_content(content, speaker="Chelsie", max_tokens=12, seed=4, video=with_track)
    assert message.content == text
    assert wav_of(message.model_dump()) == wav
    # The track's tokens (13 a second: 100 mel frames per chunk, downsampled 8x; the AAC encoder's priming
    # makes its 2 s 2.1 s) and the audio markers around them.
    mel_frames = math.ceil(track.size / 160)
    chunks, rest = divmod(mel_frames, 100)
    track_tokens = chunks * 13 + (((rest - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1
    assert reply.usage is not None
    assert reply.usage.prompt_tokens - await prompt_tokens(serve, content) == track_tokens + 2


@pytest.mark.slow
async def test_prompt_tokens_grow_with_the_frames(serve: Served) -> None:
    """48 x 64 frames become 320 x 448 (Qwen3's minimum of 128 x 32 x 32 pixels): 20 x 28 patches of 16,
    merged 2 x 2 into 140 tokens per temporal patch of 2 frames. 384 x 512 frames stay as they are: 12 x 16
    merged patches, 192 tokens (Qwen2.5-Omni's 28-pixel merged patches would make them 392 x 504: 252)."""
    two = await prompt_tokens(serve, [video_part(mp4_file(2))])
    assert await prompt_tokens(serve, [video_part(mp4_file(4))]) - two == 140 * 2
    assert await prompt_tokens(serve, [video_part(mp4_file(2, height=384, width=512))]) - two == (192 - 140) * 2
    assert await prompt_tokens(serve, [video_part(mp4_file(4), num_frames=6)]) - two == 140
    # 30 frames a second are sampled down to 2 a second: the same 4 frames' worth of tokens.
    assert await prompt_tokens(serve, [video_part(mp4_file(2, fps=30))]) == two


@pytest.mark.slow
async def test_a_video_without_a_track_for_use_audio_in_video_is_a_400_naming_its_part(serve: Served) -> None:
    content = [{"type": "text", "text": QUESTION}, video_part(mp4_file(2))]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **USE_AUDIO_IN_VIDEO}
    resp = await serve.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages[0].content[1]"
    assert "no audio track" in resp.json()["error"]["message"]
