"""Omni mode (chat with text and audio out): ``omnimodel serve`` (one process, in-memory hand-off) against
a gateway with one process per stage, interleaved on the same prompts: latency, time to first text and
first audio, real-time factor."""

# Imports sit inside functions on purpose: each mode pulls in only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

from omnimodel_runtime.bench.chat import PROMPTS
from omnimodel_runtime.bench.common import GatewayClient, pct


def selected(args: argparse.Namespace) -> bool:
    from omnimodel_runtime.pipeline import Modality, Route, get_preset

    if args.mode != "auto":
        return bool(args.mode == "omni")
    preset = get_preset(args.preset)
    return Route.CHAT in preset.routes and Modality.AUDIO in preset.modalities


@dataclass
class OmniSample:
    latency: float
    ttft: float | None  # first text delta
    ttfa: float | None  # first audio chunk (streamed) — the number a listener notices
    text_done: float | None  # last text delta
    audio_s: float

    @property
    def rtf(self) -> float | None:
        return self.latency / self.audio_s if self.audio_s > 0 else None


class OmniClient(GatewayClient):
    """Chat requests asking for text and audio (greedy thinker, fixed seed, fixed ``max_tokens``)."""

    def __init__(self, url: str, api_key: str | None, max_tokens: int) -> None:
        super().__init__(url, api_key)
        self.max_tokens = max_tokens

    def _body(self, prompt: str, stream: bool) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "modalities": ["text", "audio"],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "seed": 0,
            "stream": stream,
        }

    async def streamed(self, prompt: str) -> OmniSample:
        import base64

        started = time.perf_counter()
        ttft = ttfa = text_done = None
        pcm_bytes = 0
        async for chunk in self.sse_chunks("/v1/chat/completions", self._body(prompt, True)):
            now = time.perf_counter() - started
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content"):
                    ttft = now if ttft is None else ttft
                    text_done = now
                data = (delta.get("audio") or {}).get("data")
                if data:
                    ttfa = now if ttfa is None else ttfa
                    pcm_bytes += len(base64.b64decode(data))
        return OmniSample(time.perf_counter() - started, ttft, ttfa, text_done, pcm_bytes / 2 / 24000)

    async def whole(self, prompt: str) -> OmniSample:
        import base64
        import io
        import wave

        started = time.perf_counter()
        resp = await self._client.post("/v1/chat/completions", json=self._body(prompt, False))
        resp.raise_for_status()
        audio = resp.json()["choices"][0]["message"]["audio"]
        with wave.open(io.BytesIO(base64.b64decode(audio["data"]))) as w:
            seconds = w.getnframes() / w.getframerate()
        return OmniSample(time.perf_counter() - started, None, None, None, seconds)


def summary(samples: list[OmniSample]) -> dict[str, Any]:
    def rounded(values: list[float | None], q: float) -> float | None:
        present = [v for v in values if v is not None]
        return round(pct(present, q), 4) if present else None

    out: dict[str, Any] = {
        "requests": len(samples),
        "audio_s_mean": round(statistics.fmean(s.audio_s for s in samples), 3) if samples else None,
        "latency_p50_s": rounded([s.latency for s in samples], 50),
        "latency_p99_s": rounded([s.latency for s in samples], 99),
        # Synthesis time / duration of the audio (< 1: faster than real time).
        "rtf_p50": rounded([s.rtf for s in samples], 50),
        "rtf_p99": rounded([s.rtf for s in samples], 99),
    }
    if any(s.ttfa is not None for s in samples):
        out.update(
            ttft_p50_s=rounded([s.ttft for s in samples], 50),
            ttfa_p50_s=rounded([s.ttfa for s in samples], 50),
            ttfa_p99_s=rounded([s.ttfa for s in samples], 99),
            text_done_p50_s=rounded([s.text_done for s in samples], 50),
            # How often the first audio reached the client before the last text delta.
            audio_before_text_end=sum(
                1 for s in samples if s.ttfa is not None and s.text_done is not None and s.ttfa < s.text_done
            ),
        )
    return out


async def measure(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, Any]:
    clients = {name: OmniClient(url, args.api_key, args.max_tokens) for name, url in urls.items()}
    result: dict[str, Any] = {}
    try:
        for client in clients.values():
            client.model = await client.model_id()
            await client.whole(PROMPTS[0])  # connection set-up and lazy work outside the numbers
        for kind in ("streamed", "whole"):
            samples: dict[str, list[OmniSample]] = {name: [] for name in clients}
            try:
                # Interleaved (in-process, three processes, in-process, ...) so both see the same machine.
                for _ in range(args.rounds):
                    for prompt in PROMPTS:
                        for name, client in clients.items():
                            samples[name].append(await getattr(client, kind)(prompt))
            except Exception as err:
                result.setdefault("errors", {})[kind] = f"{type(err).__name__}: {err}"
                continue
            section = {name: summary(found) for name, found in samples.items()}
            base, split = section["in_process"], section["three_processes"]
            section["latency_ratio_of_medians"] = round(split["latency_p50_s"] / base["latency_p50_s"], 4)
            if kind == "streamed":
                section["ttfa_ratio_of_medians"] = round(split["ttfa_p50_s"] / base["ttfa_p50_s"], 4)
            result[kind] = section
    finally:
        for client in clients.values():
            await client.aclose()
    return result
