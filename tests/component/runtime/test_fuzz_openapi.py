"""Schema fuzzing of every preset's gateway: schemathesis reads ``/openapi.json`` of a real ``omnimodel
serve`` process (tiny model) and sends what the document allows (positive cases) and what it forbids
(negative cases) to every operation.

What must hold for each response: no 5xx; a status, content type and body the document declares for that
operation (``status_code_conformance``, ``content_type_conformance``, ``response_schema_conformance``);
a negative case refused with a 4xx (``negative_data_rejection``); and an answer within
:data:`TIME_BOUND` seconds. Bounded: :data:`EXAMPLES` cases per operation and mode, derandomized (the
same cases on every run, so CI is reproducible; ``OMNIMODEL_FUZZ_EXAMPLES`` and ``OMNIMODEL_FUZZ_SEED``
widen or vary it locally).

Positive cases are kept cheap before they are sent (:func:`_cheap`): the served model's name, at most
:data:`MAX_TOKENS` tokens, small images, short speech. That narrows what is generated, not what is
checked: every response is still held to the document.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from runtime_procs import RuntimeProcess, free_port, running, runtime_env
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi import checks

pytestmark = [
    pytest.mark.engine,
    # schemathesis' and hypothesis' own imports and strategies warn about things of theirs.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning"),
]

EXAMPLES = int(os.environ.get("OMNIMODEL_FUZZ_EXAMPLES", "50"))
SEED = os.environ.get("OMNIMODEL_FUZZ_SEED")
# Longest any one fuzzed request may take, on 2 shared CPU cores with a tiny model.
TIME_BOUND = 10.0
MAX_TOKENS = 8
# qwen-image-edit: schemathesis generates the multipart form, its image as random bytes, so every positive
# case is refused at the file check (a 400 naming image) and no fuzzed request reaches the model.
PRESETS = ["text", "tts", "text-to-image", "qwen2.5-omni", "qwen-image-edit"]

CHECKS = [
    not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@dataclass
class Tally:
    requests: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    slowest: float = 0.0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    per_operation: dict[str, dict[int, int]] = field(default_factory=dict)

    def add(self, label: str, status: int, elapsed: float) -> None:
        self.requests += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        counts = self.per_operation.setdefault(label, {})
        counts[status] = counts.get(status, 0) + 1
        self.slowest = max(self.slowest, elapsed)


@pytest.fixture(scope="module", params=PRESETS)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_cache: Path
) -> Iterator[tuple[str, str]]:
    preset: str = request.param
    tmp = tmp_path_factory.mktemp(f"fuzz-{preset}")
    args = ["serve", "--preset", preset, "--model", f"tiny://{preset}"]
    if preset == "text":
        args += ["--engine", "transformers"]
    proc = RuntimeProcess(f"serve-{preset}", args, log_dir=tmp, env=runtime_env(model_cache), port=free_port())
    with running(proc):
        proc.wait_healthy(timeout=300)
        yield preset, proc.url


# What _cheap caps (or sets) at the top level of a body.
_CAPPED = frozenset(
    {"model", "n", "num_outputs_per_prompt", "num_inference_steps", "height", "width", "size"}
    | {"max_tokens", "max_completion_tokens", "input"}
)


def _cheap(path: str, body: Any, model: str, *, images: bool) -> Any:
    """A positive case's body made cheap to answer, still valid by the schema: the served model, few
    tokens, two 32x32 images of 2 steps at most, a short text to speak."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    nested = body.get("extra_body")
    if isinstance(nested, dict):
        # Merged into the body by the server: what is capped below must not come back through it.
        body["extra_body"] = {k: v for k, v in nested.items() if k not in _CAPPED}
    if "model" in body:
        body["model"] = model
    if images:
        body["n"] = min(body.get("n") or 1, 2) if isinstance(body.get("n"), int) else 1
        body.pop("num_outputs_per_prompt", None)
        steps = body.get("num_inference_steps")
        body["num_inference_steps"] = min(steps, 2) if isinstance(steps, int) else 2
        body.pop("height", None)
        body.pop("width", None)
        body["size"] = "32x32"
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            body[key] = min(body[key], MAX_TOKENS)
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        # null is the server's default: as many tokens as the context holds (seconds on a loaded CPU).
        body["max_tokens"] = MAX_TOKENS
    if isinstance(body.get("input"), str):
        body["input"] = body["input"][:40]
    return body


def _run(operation: Any, mode: Any, base_url: str, model: str, tally: Tally, *, images: bool) -> None:
    session = requests.Session()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=SEED is None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case: Any) -> None:
        if mode == schemathesis.GenerationMode.POSITIVE:
            case.body = _cheap(case.path, case.body, model, images=images)
        started = time.monotonic()
        response = case.call(base_url=base_url, session=session, timeout=TIME_BOUND * 3)
        elapsed = time.monotonic() - started
        tally.add(f"{case.method} {case.path} {mode.value}", response.status_code, elapsed)
        label = f"{case.method} {case.path} {mode.value} -> {response.status_code}"
        if elapsed > TIME_BOUND:
            tally.failures.append(f"{label} took {elapsed:.1f} s (bound {TIME_BOUND:g} s): {case.body!r:.300}")
        wanted = [*CHECKS, *([checks.negative_data_rejection] if mode.value == "negative" else [])]
        try:
            case.validate_response(response, checks=wanted)
        except (Exception, BaseExceptionGroup) as err:  # schemathesis' FailureGroup is a BaseExceptionGroup
            tally.failures.append(f"{label}: {str(err)[:1500]}")

    try:
        one()
    except Unsatisfiable:
        # Nothing to negate: an operation without parameters or body (GET /health) has no negative case.
        assert mode.value == "negative", f"no positive case for {operation.label}"


@pytest.mark.slow
def test_every_operation_answers_as_its_document_says(server: tuple[str, str]) -> None:
    preset, url = server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    model = preset
    tally = Tally()
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            _run(operation, mode, url, model, tally, images=preset in ("text-to-image", "qwen-image-edit"))
    tally.seconds = time.monotonic() - started
    print(
        f"\nfuzz {preset}: {tally.requests} requests in {tally.seconds:.0f} s, "
        f"statuses {dict(sorted(tally.statuses.items()))}, slowest {tally.slowest:.2f} s, "
        f"{len(tally.failures)} failures"
    )
    for label, counts in sorted(tally.per_operation.items()):
        print(f"  {label}: {dict(sorted(counts.items()))}")
    assert tally.requests > 0
    assert not any(status >= 500 for status in tally.statuses), tally.failures[:5]
    assert not tally.failures, "\n".join(tally.failures[:10])
