"""Qwen3-Omni as real processes on loopback, driven by the official ``openai`` client: thinker, talker and
code2wav ``omnimodel stage`` processes behind an ``omnimodel gateway`` (the media bytes travel to the
thinker process in the request frame; rows and codes are streamed between the processes over HTTP): a WAV
and an image, and a video with its sound. Through the processes the answer is still the whole model's, byte
for byte (same seed, one torch thread on both sides). (``serve``, every stage in one process:
test_qwen3_omni_inputs.py and test_qwen3_omni_video.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from omni_helpers import (
    QWEN3,
    Qwen3Whole,
    VideoInput,
    all_frames,
    audio_part,
    audio_track,
    image_part,
    mp4_file,
    png_file,
    spoken_chat,
    video_part,
    wav_file,
)
from runtime_procs import RuntimeProcess, openai_client, runtime_env, split_deployment, stage_requests, wav_of

from omnimodel_runtime.serve import serve_pipeline

pytestmark = [
    pytest.mark.engine,
    # The whole model's talker generate() warns that its repetition penalty skips the prompt (by design).
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`:UserWarning"),
]

MODEL = QWEN3
STAGES = ("thinker", "talker", "code2wav")
# Three torch processes share the cores: one thread each; the whole model runs on one too, so the same
# float reductions in the same order give the same bits.
THREADS = 1


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_qwen3: Path
) -> Iterator[dict[str, RuntimeProcess]]:
    """The three stage processes and a gateway, started together (the tiny model built before, not raced
    for by four processes)."""
    pipeline = serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu")
    env = runtime_env(model_cache, OMNIMODEL_DEVICE="cpu", OMP_NUM_THREADS=THREADS)
    with split_deployment(pipeline, tmp_path_factory.mktemp("qwen3-procs"), env, timeout=240) as procs:
        yield procs


@pytest.mark.slow
def test_voice_chat_with_audio_and_an_image_through_stage_processes_is_the_whole_models(
    deployment: dict[str, RuntimeProcess], whole_qwen3: Qwen3Whole
) -> None:
    """A WAV and an image in, text and audio out: the thinker process's processor and encoders read them,
    the talker process reads the thinker's layer-``accept_hidden_layer`` rows at their placeholders and
    their feature lengths and patch grids, and the WAV is the whole model's."""
    before = {name: stage_requests(deployment[name].metrics(), name) for name in STAGES}
    content = [audio_part(wav_file(1)), image_part(png_file(64, 96)), {"type": "text", "text": "What is this?"}]
    spoken = spoken_chat([{"role": "user", "content": content}], voice="Chelsie", max_tokens=12, seed=13, model=MODEL)
    reply = openai_client(deployment["gateway"].url, timeout=240).chat.completions.create(**spoken)
    message = reply.choices[0].message
    assert message.audio is not None
    raw = wav_of(message.model_dump())
    text, wav = whole_qwen3.generate_content(content, speaker="Chelsie", max_tokens=12, seed=13, threads=THREADS)
    assert (message.content, message.audio.transcript) == (text, text)
    assert raw == wav
    # Each stage process served it (not a stage of the gateway's own).
    after = {name: stage_requests(deployment[name].metrics(), name) for name in STAGES}
    assert after == {name: count + 1 for name, count in before.items()}


@pytest.mark.slow
def test_a_video_with_its_sound_through_stage_processes_is_the_whole_models(
    deployment: dict[str, RuntimeProcess], whole_qwen3: Qwen3Whole
) -> None:
    """A ``video_url`` MP4 with ``use_audio_in_video``: the file travels to the thinker process, which decodes
    its frames and track; the talker process gets the video's grid and seconds per temporal patch in the
    prompt frame. The WAV is the whole model's on the same frames and track."""
    video = mp4_file(2, audio=True, seed=2)
    content = [{"type": "text", "text": "What happens?"}, video_part(video)]
    spoken = spoken_chat([{"role": "user", "content": content}], voice="Ethan", max_tokens=10, seed=6, model=MODEL)
    reply = openai_client(deployment["gateway"].url, timeout=240).chat.completions.create(
        **spoken, extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}}
    )
    message = reply.choices[0].message
    assert message.audio is not None
    frames = VideoInput(all_frames(video), 2.0, audio=audio_track(video))
    text, wav = whole_qwen3.generate_content(
        content, speaker="Ethan", max_tokens=10, seed=6, threads=THREADS, video=frames
    )
    assert (message.content, message.audio.transcript) == (text, text)
    assert wav_of(message.model_dump()) == wav
