"""What both text-generation engines share: prompt rendering, sampling defaults, limits, detokenization.

Both adapters feed their engine the same token ids (rendered here with the model directory's own
tokenizer and chat template) and resolve "unset" sampling fields from the same generation_config, so
the same checkpoint gives the same greedy output on either engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import StageRequest


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer used here."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults and end-of-sequence ids read from a model directory."""

    temperature: float = 1.0
    top_p: float = 1.0
    eos_token_ids: frozenset[int] = frozenset()

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> GenerationDefaults:
        """Read ``generation_config.json`` (falling back to ``config.json`` for eos ids)."""
        gen = _read_json(model_dir / "generation_config.json")
        cfg = _read_json(model_dir / "config.json")
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # do_sample=False in the checkpoint means greedy unless the request says otherwise.
        do_sample = gen.get("do_sample", True)
        temperature = float(gen.get("temperature", 1.0)) if do_sample else 0.0
        return cls(temperature=temperature, top_p=float(gen.get("top_p", 1.0)), eos_token_ids=eos_ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


SAMPLING_EPS: Final = 1e-5


@dataclass(frozen=True)
class ResolvedSampling:
    """Sampling with every default filled in and limits checked."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool

    @property
    def greedy(self) -> bool:
        # Below this, dividing the logits by the temperature only overflows (the API accepts any float
        # down to 5e-324): it is the best token anyway, so draw it without sampling (vLLM does the same).
        return self.temperature < SAMPLING_EPS


def check_token_ids(ids: Sequence[int], vocab_size: int, *, param: str = "prompt") -> None:
    """A 400 naming ``param`` unless every id indexes the model's vocabulary (``0 <= id < vocab_size``).

    Checked on the event loop before a request joins a batch: an id outside the embedding table fails the
    forward pass it is in ("index out of range in self"), and with it every other row of that step.
    """
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise StageError(
            f"token id {bad} is out of vocabulary (this model's token ids are 0 to {vocab_size - 1})",
            status=400,
            param=param,
        )


def render_prompt(tokenizer: Tokenizer, request: StageRequest, *, vocab_size: int) -> list[int]:
    """The prompt token ids of a text-generation request, each checked against ``vocab_size``.

    Chat messages go through the tokenizer's chat template with the generation prompt appended and are
    then tokenized without adding special tokens (the template already has them), as vLLM's server does.
    """
    given = [x is not None for x in (request.messages, request.prompt, request.prompt_token_ids)]
    if sum(given) != 1:
        raise StageError(
            "a text-generation request needs exactly one of messages, prompt or prompt_token_ids", status=400
        )
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
    elif request.messages is not None:
        try:
            text = tokenizer.apply_chat_template(
                [dict(m) for m in request.messages], add_generation_prompt=True, tokenize=False
            )
        except Exception as err:  # jinja errors and template-raised exceptions alike
            raise StageError(f"cannot apply the chat template: {err}", status=400, param="messages") from err
        ids = tokenizer.encode(str(text), add_special_tokens=False)
    else:
        ids = tokenizer.encode(request.prompt or "")
    if not ids:
        raise StageError("the prompt is empty", status=400, param="prompt")
    check_token_ids(ids, vocab_size)
    return ids


def resolve_sampling(
    request: StageRequest, defaults: GenerationDefaults, *, prompt_len: int, max_model_len: int
) -> ResolvedSampling:
    """Fill unset sampling fields from ``defaults`` and check the context limit (vLLM's rule: a request
    asking for more than fits is a 400, not silently truncated)."""
    room = max_model_len - prompt_len
    if room < 1:
        raise StageError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has {prompt_len} tokens",
            status=400,
            param="messages",
        )
    s = request.sampling
    if s.max_tokens is not None and s.max_tokens > room:
        raise StageError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens, so max_tokens may be at most {room} (got {s.max_tokens})",
            status=400,
            param="max_tokens",
        )
    return ResolvedSampling(
        max_tokens=s.max_tokens if s.max_tokens is not None else room,
        temperature=defaults.temperature if s.temperature is None else s.temperature,
        top_p=defaults.top_p if s.top_p is None else s.top_p,
        seed=s.seed,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
    )


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, holding back what is not final yet.

    Two things are not final: an incomplete UTF-8 character (byte-level tokens split characters; the
    decoder then ends in U+FFFD) and a tail that could be the start of a stop string. Decoding uses
    vLLM's prefix/read offsets, so each step decodes a few tokens, not the whole output.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""
        self._sent = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; return the text that became final. Sets ``stopped`` on a stop string."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = self._tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._release()

    def flush(self) -> str:
        """At the end of generation: everything not yet sent (minus any stop string)."""
        if self.stopped:
            return ""
        if self._read_offset < len(self._ids):
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
            full = self._tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
            self._text += full[len(prefix) :]
            self._read_offset = len(self._ids)
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._text[: self._sent]

    def _release(self) -> str:
        if self.stopped:
            return ""
        if self._stop:
            longest = max(len(s) for s in self._stop)
            window_start = max(0, self._sent - longest + 1)
            hits = [p for s in self._stop if (p := self._text.find(s, window_start)) != -1]
            if hits:
                end = min(hits)
                out = self._text[self._sent : end]
                self._text = self._text[:end]
                self._sent = end
                self.stopped = True
                return out
            safe = len(self._text) - _partial_stop_len(self._text, self._stop)
        else:
            safe = len(self._text)
        out = self._text[self._sent : safe] if safe > self._sent else ""
        self._sent = max(self._sent, safe)
        return out


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
