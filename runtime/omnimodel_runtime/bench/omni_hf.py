"""The omni bench's baseline: Hugging Face's whole model (``Qwen2_5OmniForConditionalGeneration.generate()``)
in a process of its own, started after the measured deployments have stopped, so the two never share the
accelerator's memory (beside the engines the whole 7B model ran an 80 GB H100 out of memory).

``python -m omnimodel_runtime.bench.omni_hf --model M --max-tokens N --requests R --out F``: one warm-up
request, then ``R`` requests on the bench's prompts (the ones the sequential rounds use, in that order);
writes ``{"samples": [{latency, audio_s, text_tokens}, ...]}`` to ``F``. The parent (:func:`run_baseline`)
turns them into the same summary as the deployments'."""

# Imports sit inside functions on purpose: the parent only starts the process.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omnimodel_runtime.bench.chat import PROMPTS
from omnimodel_runtime.bench.omni import OmniSample, summary


class HfWhole:
    """Hugging Face's ``Qwen2_5OmniForConditionalGeneration.generate()`` on this machine's device (bf16 on an
    accelerator, fp32 on CPU), greedy thinker held to ``max_tokens`` like the served requests, the talker's
    own sampling and the model's token2wav. The whole model returns its audio only at the end, so its time
    to first audio is its latency."""

    def __init__(self, model: str, max_tokens: int) -> None:
        import torch
        from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

        from omnimodel_runtime.bench.common import device
        from omnimodel_runtime.layout import OMNI_GENERATION_FILE
        from omnimodel_runtime.models import resolve_model_dir
        from omnimodel_runtime.pipeline import ModelSource
        from omnimodel_runtime.settings import RuntimeSettings

        self.max_tokens = max_tokens
        self.where = device()
        model_dir = resolve_model_dir(ModelSource(source=model), RuntimeSettings())
        dtype = torch.float32 if self.where == "cpu" else torch.bfloat16
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(self.where).eval()
        self.model.token2wav.float()  # as the released model runs it (and the code2wav stage does)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        generation_file = model_dir / OMNI_GENERATION_FILE
        self.talker = (json.loads(generation_file.read_text()) if generation_file.is_file() else {}).get("talker", {})

    def sample(self, prompt: str) -> OmniSample:
        import torch

        model, where = self.model, self.where
        messages = [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).to(where)
        if where != "cpu":
            torch.cuda.synchronize()
        started = time.perf_counter()
        torch.manual_seed(0)
        with torch.inference_mode():
            sequences, waveform = model.generate(
                **inputs,
                thinker_max_new_tokens=self.max_tokens,
                thinker_min_new_tokens=self.max_tokens,
                thinker_do_sample=False,
                talker_max_new_tokens=int(self.talker.get("max_new_tokens", 4096)),
                talker_eos_token_id=[model.talker.codec_pad_token, model.talker.codec_eos_token],
            )
        if where != "cpu":
            torch.cuda.synchronize()
        latency = time.perf_counter() - started
        tokens = int(sequences.shape[1] - inputs["input_ids"].shape[1])
        return OmniSample(latency, None, latency, None, waveform.numel() / 24000, tokens)


def prompts(count: int, offered: int) -> list[str]:
    """The prompts of the baseline's requests: the bench's sequential rounds cycle through ``offered``."""
    pool = PROMPTS[: max(1, offered)]
    return [pool[i % len(pool)] for i in range(count)]


def run_baseline(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start the baseline process, wait for it (``--start-timeout`` plus a minute a request) and summarise
    its samples as ``hf_whole_model`` (first audio = latency)."""
    out = workdir / "hf-whole.json"
    log = workdir / "hf-whole.log"
    cmd = [
        sys.executable,
        "-m",
        "omnimodel_runtime.bench.omni_hf",
        "--model",
        args.model,
        "--max-tokens",
        str(args.max_tokens),
        "--requests",
        str(args.hf_baseline),
        "--prompts",
        str(args.omni_prompts),
        "--out",
        str(out),
    ]
    with log.open("wb") as sink:
        done = subprocess.run(
            cmd,
            check=False,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=args.start_timeout + 60 * (args.hf_baseline + 1),
        )
    if done.returncode != 0:
        raise RuntimeError(f"the whole-model process exited with {done.returncode}: {log.read_text()[-1500:]}")
    raw = json.loads(out.read_text())["samples"]
    samples = [OmniSample(s["latency"], None, s["latency"], None, s["audio_s"], s["text_tokens"]) for s in raw]
    section = summary(samples)
    section["ttfa_p50_s"] = section["latency_p50_s"]
    section["latency_s"] = [round(s.latency, 3) for s in samples]
    return section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnimodel_runtime.bench.omni_hf", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="how many of the bench's prompts to cycle through")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    whole = HfWhole(args.model, args.max_tokens)
    whole.sample(PROMPTS[0])  # warm-up: lazy initialisation and kernel selection outside the numbers
    samples = [whole.sample(prompt) for prompt in prompts(args.requests, args.prompts)]
    rows = [{"latency": s.latency, "audio_s": s.audio_s, "text_tokens": s.text_tokens} for s in samples]
    with tempfile.NamedTemporaryFile("w", dir=args.out.parent, delete=False) as tmp:
        json.dump({"samples": rows}, tmp)
    Path(tmp.name).replace(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
