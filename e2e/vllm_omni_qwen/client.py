"""Text and text+audio chat against a vLLM-Omni head through the official openai client.

    python client.py [--base-url URL] [--audio] [--talker-max-tokens N] [--timeout S]
Prints one JSON line: status, latency, text, and for audio the WAV's rate/frames/RMS (decoded).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import time
import wave

import openai


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.2:8000/v1")
    p.add_argument("--audio", action="store_true")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--talker-max-tokens", type=int, default=None, help="per-request cap via sampling_params_list")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--model", default=None)
    a = p.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="none", timeout=a.timeout, max_retries=0)
    model = a.model or client.models.list().data[0].id
    extra: dict[str, object] = {"modalities": ["text", "audio"] if a.audio else ["text"]}
    if a.talker_max_tokens is not None:
        # One entry per stage; a dict replaces that stage's YAML defaults entirely, so repeat them.
        extra["sampling_params_list"] = [
            {"temperature": 0.0, "max_tokens": a.max_tokens, "seed": 42, "repetition_penalty": 1.1},
            {
                "temperature": 0.9,
                "top_p": 0.8,
                "top_k": 40,
                "max_tokens": a.talker_max_tokens,
                "seed": 42,
                "repetition_penalty": 1.05,
                "stop_token_ids": [8294],
            },
            {"temperature": 0.0, "max_tokens": 4096, "seed": 42},
        ]
    t0 = time.monotonic()
    out: dict[str, object] = {"audio_requested": a.audio}
    try:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello tiny world"}],
            max_tokens=a.max_tokens,
            extra_body=extra,
        )
        out["status"] = 200
        texts, wavs = [], []
        for ch in r.choices:
            if ch.message.content:
                texts.append(ch.message.content)
            audio = getattr(ch.message, "audio", None)
            if audio is not None and getattr(audio, "data", None):
                wavs.append(base64.b64decode(audio.data))
        out["text"] = texts
        for raw in wavs:
            with wave.open(io.BytesIO(raw)) as w:
                frames = w.readframes(w.getnframes())
                import array

                samples = array.array("h", frames)
                rms = (sum(s * s for s in samples) / max(1, len(samples))) ** 0.5 / 32768
                out["wav"] = {
                    "rate": w.getframerate(),
                    "frames": w.getnframes(),
                    "channels": w.getnchannels(),
                    "seconds": round(w.getnframes() / w.getframerate(), 3),
                    "rms": round(rms, 4),
                }
        out["choices"] = len(r.choices)
    except openai.APIStatusError as e:
        out["status"] = e.status_code
        out["error"] = str(e)[:500]
    except openai.APIConnectionError as e:
        out["status"] = "connection-error"
        out["error"] = repr(e)[:300]
    out["latency_s"] = round(time.monotonic() - t0, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
