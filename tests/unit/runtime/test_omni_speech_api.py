"""``/v1/audio/speech`` on the omni preset, against the fake thinker/talker/code2wav engines of
omni_fakes.py: what the thinker is asked (speak the input, not answer it) and that only audio
comes back, although the thinker writes text. The real engines: tests/component/runtime/test_omni_speech.py."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from omni_fakes import RATE, OmniServe, expected_waveform
from runtime_fakes import openai_client

from omnimodel_runtime.protocol.stage import StageParams


def pcm_of_the_pipeline() -> bytes:
    return np.round(expected_waveform() * 32767).astype("<i2").tobytes()


async def test_the_thinker_is_told_to_speak_the_input_and_only_audio_comes_back(
    omni: OmniServe, omni_http: httpx.AsyncClient
) -> None:
    resp = await openai_client(omni_http).audio.speech.create(
        model="qwen2.5-omni", voice="Ethan", input="Read me.", response_format="pcm"
    )
    assert resp.response.headers["content-type"] == "audio/pcm"
    assert resp.response.headers["x-sample-rate"] == str(RATE)
    # The fake thinker wrote " w0 w1 ...": none of it reaches the client.
    assert resp.content == pcm_of_the_pipeline()
    (inp,) = omni.thinker.requests
    assert inp.request.prompt == "Read me."
    assert inp.request.messages is None
    assert inp.request.params == StageParams(voice="Ethan", speed=1.0, speak=True)
    # Every stage gets the same request: code2wav runs whole for a whole file.
    assert omni.code2wav.requests[0].request.stream is False


async def test_a_stream_is_raw_pcm_and_chunked_on_code2wav(omni: OmniServe, omni_http: httpx.AsyncClient) -> None:
    resp = await omni_http.post(
        "/v1/audio/speech",
        json={"model": "qwen2.5-omni", "input": "Read me.", "voice": "Chelsie", "stream": True, "seed": 3},
    )
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "audio/pcm"
    assert resp.content == pcm_of_the_pipeline()
    request = omni.code2wav.requests[0].request
    assert (request.stream, request.sampling.seed) == (True, 3)


@pytest.mark.parametrize("seed", [2**64, 2**63])
async def test_a_seed_no_generator_takes_is_a_400_naming_it(
    omni: OmniServe, omni_http: httpx.AsyncClient, seed: int
) -> None:
    resp = await omni_http.post("/v1/audio/speech", json={"model": "qwen2.5-omni", "input": "Read me.", "seed": seed})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "seed"
    assert omni.thinker.requests == []
