"""Prompt rendering, sampling defaults and incremental detokenization shared by the text engines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from omnimodel_runtime.engines.text.common import (
    GenerationDefaults,
    IncrementalDetokenizer,
    render_prompt,
    resolve_sampling,
)
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import SamplingParams, StageRequest


class ByteTokenizer:
    """Token id = one byte, like the byte-level tokens that split a multi-byte UTF-8 character."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        if any(m["role"] == "bad" for m in conversation):
            raise ValueError("unknown role")
        text = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return text + ("<assistant>" if kwargs.get("add_generation_prompt") else "")

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return bytes(ids).decode(errors="replace")


def _feed(detok: IncrementalDetokenizer, text: str) -> list[str]:
    out = []
    for b in text.encode():
        out.append(detok.add(b))
        if detok.stopped:
            break
    return out


def test_deltas_hold_back_incomplete_utf8_characters() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    deltas = _feed(detok, "a☃b")
    # ☃ is three bytes: nothing is released until the last one arrives, and never a U+FFFD.
    assert deltas == ["a", "", "", "☃", "b"]
    assert "".join(deltas) + detok.flush() == "a☃b"


def test_stop_string_cuts_the_output_and_is_not_emitted() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["STOP"])
    deltas = _feed(detok, "hello STOP and more")
    assert detok.stopped
    assert "".join(deltas) == "hello "
    assert detok.flush() == ""


def test_text_that_may_start_a_stop_string_waits_then_is_released() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["<end>"])
    deltas = _feed(detok, "a<en")
    assert "".join(deltas) == "a"  # "<en" could still become "<end>"
    assert detok.add(ord("x")) == "<enx"
    assert not detok.stopped
    assert detok.flush() == ""
    assert detok.text == "a<enx"


def test_flush_releases_a_partial_stop_at_the_end() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["##"])
    assert "".join(_feed(detok, "ab#")) == "ab"
    assert detok.flush() == "#"


def test_earliest_of_several_stop_strings_wins() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["world", "lo w"])
    assert "".join(_feed(detok, "hello world")) == "hel"


def _request(**kwargs: Any) -> StageRequest:
    return StageRequest(request_id="r", **kwargs)


def test_chat_messages_go_through_the_template_with_a_generation_prompt() -> None:
    ids = render_prompt(ByteTokenizer(), _request(messages=({"role": "user", "content": "hi"},)), vocab_size=256)
    assert bytes(ids) == b"<user>hi<assistant>"


def test_prompt_and_token_ids_are_used_as_given() -> None:
    assert render_prompt(ByteTokenizer(), _request(prompt="ab"), vocab_size=256) == [97, 98]
    assert render_prompt(ByteTokenizer(), _request(prompt_token_ids=(5, 6)), vocab_size=256) == [5, 6]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"prompt": "a", "prompt_token_ids": (1,)}, {"prompt": ""}, {"messages": ({"role": "bad", "content": ""},)}],
)
def test_unusable_inputs_are_400(kwargs: dict[str, Any]) -> None:
    with pytest.raises(StageError) as info:
        render_prompt(ByteTokenizer(), _request(**kwargs), vocab_size=256)
    assert info.value.status == 400


@pytest.mark.parametrize("ids", [(256,), (1, 999999, 2)])
def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_prompt(ids: tuple[int, ...]) -> None:
    with pytest.raises(StageError) as info:
        render_prompt(ByteTokenizer(), _request(prompt_token_ids=ids), vocab_size=256)
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert "out of vocabulary" in info.value.message


@pytest.mark.parametrize("ids", [[-1], [10**23], [2**31]])
def test_token_ids_no_vocabulary_has_are_refused_by_the_wire_models(ids: list[int]) -> None:
    from pydantic import ValidationError

    from omnimodel_runtime.protocol.openai import CompletionRequest

    with pytest.raises(ValidationError):
        CompletionRequest(prompt=ids)
    with pytest.raises(ValidationError):
        _request(prompt_token_ids=tuple(ids))


def test_sampling_defaults_come_from_the_model_and_fill_the_context(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "eos_token_id": [2, 0]})
    )
    defaults = GenerationDefaults.from_model_dir(tmp_path)
    assert defaults.eos_token_ids == frozenset({0, 2})
    s = resolve_sampling(_request(prompt="x"), defaults, prompt_len=10, max_model_len=100)
    assert (s.temperature, s.top_p, s.max_tokens) == (0.7, 0.8, 90)
    explicit = _request(prompt="x", sampling=SamplingParams(temperature=0.0, top_p=0.5, max_tokens=5))
    s = resolve_sampling(explicit, defaults, prompt_len=10, max_model_len=100)
    assert (s.greedy, s.top_p, s.max_tokens) == (True, 0.5, 5)


def test_a_checkpoint_without_sampling_means_greedy(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    defaults = GenerationDefaults.from_model_dir(tmp_path)
    assert defaults.temperature == 0.0
    assert defaults.eos_token_ids == frozenset({7})


def test_requests_that_do_not_fit_the_context_are_400_naming_the_limit() -> None:
    defaults = GenerationDefaults()
    with pytest.raises(StageError, match="at most 6") as info:
        resolve_sampling(
            _request(prompt="x", sampling=SamplingParams(max_tokens=7)), defaults, prompt_len=10, max_model_len=16
        )
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    with pytest.raises(StageError, match="prompt has 16 tokens") as info:
        resolve_sampling(_request(prompt="x"), defaults, prompt_len=16, max_model_len=16)
    assert info.value.status == 400
