"""Omni mode (chat with text and audio out): ``omnimodel serve`` (one process, in-memory hand-off) against
a gateway with one process per stage, interleaved on the same prompts: latency, time to first text and
first audio, real-time factor; then a concurrency ladder (streamed requests at each ``--omni-concurrency``
level: first audio p50 and max, RTF p50, requests/s, failures). Hugging Face's whole model is the
baseline, in a process of its own once the deployments have stopped (:mod:`.omni_hf`)."""

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
    text_tokens: int = 0

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
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }

    async def streamed(self, prompt: str) -> OmniSample:
        import base64

        started = time.perf_counter()
        ttft = ttfa = text_done = None
        pcm_bytes = 0
        tokens = 0
        async for chunk in self.sse_chunks("/v1/chat/completions", self._body(prompt, True)):
            now = time.perf_counter() - started
            usage = chunk.get("usage") or {}
            tokens = int(usage.get("completion_tokens") or tokens)
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content"):
                    ttft = now if ttft is None else ttft
                    text_done = now
                data = (delta.get("audio") or {}).get("data")
                if data:
                    ttfa = now if ttfa is None else ttfa
                    pcm_bytes += len(base64.b64decode(data))
        return OmniSample(time.perf_counter() - started, ttft, ttfa, text_done, pcm_bytes / 2 / 24000, tokens)

    async def whole(self, prompt: str) -> OmniSample:
        import base64
        import io
        import wave

        started = time.perf_counter()
        resp = await self._client.post("/v1/chat/completions", json=self._body(prompt, False))
        resp.raise_for_status()
        answer = resp.json()
        audio = answer["choices"][0]["message"]["audio"]
        with wave.open(io.BytesIO(base64.b64decode(audio["data"]))) as w:
            seconds = w.getnframes() / w.getframerate()
        tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
        return OmniSample(time.perf_counter() - started, None, None, None, seconds, tokens)


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
        # End to end: the answer's text tokens over the whole request's time (text and audio).
        "text_tok_s_p50": rounded([s.text_tokens / s.latency if s.latency > 0 else None for s in samples], 50),
    }
    if any(s.ttfa is not None for s in samples):
        out.update(
            ttft_p50_s=rounded([s.ttft for s in samples], 50),
            ttfa_p50_s=rounded([s.ttfa for s in samples], 50),
            ttfa_p99_s=rounded([s.ttfa for s in samples], 99),
            ttfa_max_s=rounded([s.ttfa for s in samples], 100),
            text_done_p50_s=rounded([s.text_done for s in samples], 50),
            # How often the first audio reached the client before the last text delta.
            audio_before_text_end=sum(
                1 for s in samples if s.ttfa is not None and s.text_done is not None and s.ttfa < s.text_done
            ),
        )
    return out


async def measure(
    args: argparse.Namespace, urls: dict[str, str], scrape: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """Every section on each deployment of ``urls``; ``scrape``: the URLs whose ``/metrics`` hold each
    deployment's stage metrics (read around every concurrency level, :func:`stage_load`)."""
    clients = {name: OmniClient(url, args.api_key, args.max_tokens) for name, url in urls.items()}
    prompts = PROMPTS[: max(1, args.omni_prompts)]
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
                    for prompt in prompts:
                        for name, client in clients.items():
                            samples[name].append(await getattr(client, kind)(prompt))
            except Exception as err:
                result.setdefault("errors", {})[kind] = f"{type(err).__name__}: {err}"
                continue
            section = {name: summary(found) for name, found in samples.items()}
            if "in_process" in section and "three_processes" in section:
                base, split = section["in_process"], section["three_processes"]
                section["latency_ratio_of_medians"] = round(split["latency_p50_s"] / base["latency_p50_s"], 4)
                if kind == "streamed":
                    section["ttfa_ratio_of_medians"] = round(split["ttfa_p50_s"] / base["ttfa_p50_s"], 4)
            result[kind] = section
        try:
            result["concurrency"] = await ladder(args, clients, scrape)
        except Exception as err:
            result.setdefault("errors", {})["concurrency"] = f"{type(err).__name__}: {err}"
    finally:
        for client in clients.values():
            await client.aclose()
    return result


async def ladder(
    args: argparse.Namespace, clients: dict[str, OmniClient], scrape: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """Streamed requests at each concurrency level (``--omni-concurrency``), every deployment in turn:
    ``max(level, --omni-requests)`` per level, each of ``level`` clients sending its next when its last has
    returned. A failed request (an HTTP error, an error chunk, a dropped stream) is counted under
    ``failures`` and the level goes on; ``requests_per_s`` counts the requests that succeeded over the
    level's wall time, ``ttfa_max_s`` is the slowest first audio of the level, ``text_tok_s_aggregate`` all
    text tokens over the wall time. Where ``scrape`` names the deployment's metrics URLs, ``stages`` gives
    each stage's load over the level (:func:`stage_load`) and ``busiest_stage`` the one with the highest
    busy fraction."""
    from omnimodel_runtime.bench.common import concurrently

    out: dict[str, Any] = {}
    for name, client in clients.items():
        levels: dict[str, Any] = {}
        metrics_urls = (scrape or {}).get(name) or []
        for level in args.omni_concurrency:
            before = await stage_counters(metrics_urls) if metrics_urls else None
            count = max(level, args.omni_requests)
            items = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
            errors: list[str] = []

            async def attempt(
                prompt: str, client: OmniClient = client, errors: list[str] = errors
            ) -> OmniSample | None:
                try:
                    return await client.streamed(prompt)
                except Exception as err:  # counted: a level's failures are one of its figures
                    errors.append(f"{type(err).__name__}: {err}")
                    return None

            started = time.time()
            outcomes, wall = await concurrently(attempt, items, level)
            samples = [s for s in outcomes if s is not None]
            section = summary(samples)
            section.update(
                concurrency=level,
                failures=len(errors),
                wall_s=round(wall, 3),
                # Unix time of the level's first request: lines up a device sampler's log (bench/h200.sh).
                started_unix=round(started, 3),
                requests_per_s=round(len(samples) / wall, 3),
                text_tok_s_aggregate=round(sum(s.text_tokens for s in samples) / wall, 2),
                audio_s_per_s=round(sum(s.audio_s for s in samples) / wall, 3),
            )
            if errors:
                section["failure_examples"] = sorted(set(errors))[:3]
            if before is not None:
                section["stages"] = stage_load(before, await stage_counters(metrics_urls), wall)
                busy = {stage: f["busy_fraction"] for stage, f in section["stages"].items() if "busy_fraction" in f}
                if busy:
                    section["busiest_stage"] = max(busy, key=lambda stage: busy[stage])
            levels[str(level)] = section
        base = levels.get(str(min(args.omni_concurrency)))
        for section in levels.values():
            if base and base.get("ttfa_p50_s") and section.get("ttfa_max_s") is not None:
                section["ttfa_max_over_lowest_p50"] = round(section["ttfa_max_s"] / base["ttfa_p50_s"], 3)
        out[name] = levels
    return out


# The stage metrics a level's load is read from: Prometheus sample name -> key of stage_counters' result.
_COUNTERS = {
    "omnimodel_engine_busy_seconds_total": "busy_s",
    "omnimodel_engine_admitted_total": "admitted",
    "omnimodel_engine_queue_wait_seconds_total": "queue_wait_s",
    "omnimodel_batch_size_count": "steps",
    "omnimodel_batch_size_sum": "batch_rows",
    "omnimodel_generated_tokens_total": "generated",
}


async def stage_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    """Each stage's counters (:data:`_COUNTERS`) from the ``/metrics`` of ``urls`` (stage processes, or
    ``omnimodel serve``, whose one page has every stage), by the ``stage`` label."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=30) as http:
        for url in urls:
            resp = await http.get(f"{url}/metrics")
            resp.raise_for_status()
            for family in text_string_to_metric_families(resp.text):
                for sample in family.samples:
                    key = _COUNTERS.get(sample.name)
                    stage = sample.labels.get("stage")
                    if key is not None and stage is not None:
                        out.setdefault(stage, {})[key] = float(sample.value)
    return out


def stage_load(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], wall: float) -> dict[str, Any]:
    """Each stage's load between two :func:`stage_counters` readings ``wall`` seconds apart, what names a
    saturated stage: ``busy_fraction`` (its worker's seconds in model calls over the wall time: near 1, the
    stage cannot go faster), ``steps`` (batched steps or passes; a request served whole counts one) and
    ``mean_batch`` (requests a step), ``busy_ms_per_step``, ``queue_wait_mean_s`` (submission to the
    worker taking a request) and ``generated_per_s`` (the stage's output tokens: text tokens, codec codes)."""
    out: dict[str, Any] = {}
    for stage, now in sorted(after.items()):
        then = before.get(stage, {})

        def delta(key: str, now: dict[str, float] = now, then: dict[str, float] = then) -> float | None:
            return now[key] - then.get(key, 0.0) if key in now else None

        figures: dict[str, Any] = {}
        busy, steps, rows = delta("busy_s"), delta("steps"), delta("batch_rows")
        admitted, wait, generated = delta("admitted"), delta("queue_wait_s"), delta("generated")
        if busy is not None:
            figures["busy_fraction"] = round(busy / wall, 4)
        if steps is not None:
            figures["steps"] = int(steps)
            if steps > 0 and rows is not None:
                figures["mean_batch"] = round(rows / steps, 3)
            if steps > 0 and busy is not None:
                figures["busy_ms_per_step"] = round(busy / steps * 1000, 3)
        if admitted is not None and wait is not None:
            figures["requests"] = int(admitted)
            if admitted > 0:
                figures["queue_wait_mean_s"] = round(wait / admitted, 4)
        if generated is not None:
            figures["generated_per_s"] = round(generated / wall, 2)
        out[stage] = figures
    return out


def versus_hf(results: dict[str, Any]) -> dict[str, Any]:
    """Ours against the whole model, per deployment: end-to-end text tokens/s of the sequential streamed
    requests (the same prompts the baseline ran) and at each concurrency level (per request and in
    aggregate), time to first audio and real-time factor."""
    hf = results["hf_whole_model"]

    def row(section: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if hf.get("text_tok_s_p50") and section.get("text_tok_s_p50"):
            out["text_tok_s_ratio"] = round(section["text_tok_s_p50"] / hf["text_tok_s_p50"], 2)
            if "text_tok_s_aggregate" in section:
                out["text_tok_s_aggregate_ratio"] = round(section["text_tok_s_aggregate"] / hf["text_tok_s_p50"], 2)
        if hf.get("ttfa_p50_s") and section.get("ttfa_p50_s"):
            out["ttfa_ratio"] = round(section["ttfa_p50_s"] / hf["ttfa_p50_s"], 4)
        if hf.get("rtf_p50") and section.get("rtf_p50"):
            out["rtf_ratio"] = round(section["rtf_p50"] / hf["rtf_p50"], 4)
        return out

    out: dict[str, Any] = {}
    for name, section in (results.get("streamed") or {}).items():
        if isinstance(section, dict):
            out.setdefault(name, {})["sequential"] = row(section)
    for name, levels in (results.get("concurrency") or {}).items():
        for level, section in levels.items():
            out.setdefault(name, {})[level] = row(section)
    return out
