"""The runtime as real processes on loopback: ``omnimodel serve``, and ``omnimodel stage`` +
``omnimodel gateway`` from one pipeline file, driven by the official ``openai`` client.

Also the failure behaviour a user would see: a client that goes away cancels the stage's work, a stage
killed mid-request fails the request fast with a 5xx, the gateway's /health follows the stage, and a
restarted stage is used again; SIGTERM drains in-flight requests before the stage exits.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from runtime_procs import (
    RuntimeProcess,
    free_port,
    gateway_process,
    metric_value,
    openai_client,
    pipeline_file,
    running,
    runtime_env,
    serve_process,
    split_deployment,
    stage_process,
    wait_for,
)

from omnimodel_runtime.serve import serve_pipeline

pytestmark = [pytest.mark.engine]

USER = [{"role": "user", "content": "Hello there, what is the model?"}]
# Long enough that a request is certainly still running when the test acts on it (thousands of
# decode steps); the tests never wait for it to finish.
LONG = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}


PIPELINE = serve_pipeline("text", "tiny://text", engines=["transformers"], device="cpu")


def _check_openai_api(url: str) -> None:
    """What the issue's acceptance asks of a running gateway, through the official client."""
    client = openai_client(url, timeout=60)
    assert [m.id for m in client.models.list().data] == ["text"]

    reply = client.chat.completions.create(model="text", messages=USER, max_tokens=16)  # type: ignore[arg-type]
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    stream = client.chat.completions.create(model="text", messages=USER, max_tokens=16, stream=True)  # type: ignore[arg-type]
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 3

    completion = client.completions.create(model="text", prompt="Once upon a time", max_tokens=8)
    assert completion.choices[0].text
    assert completion.usage is not None
    streamed = client.completions.create(model="text", prompt="Once upon a time", max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text


@pytest.mark.slow
def test_serve_runs_everything_in_one_process(tmp_path: Path, model_cache: Path, tiny_text: Path) -> None:
    serve = serve_process("text", tmp_path, runtime_env(model_cache), "--engine", "transformers")
    with running(serve):
        serve.wait_healthy()
        _check_openai_api(serve.url)
        metrics = serve.get("/metrics")
        assert metrics is not None
        # Gateway and stage metrics share the process's one /metrics.
        assert (metric_value(metrics.text, "omnimodel_generated_tokens_total", {"stage": "llm"}) or 0) > 0
        assert metric_value(metrics.text, "omnimodel_http_requests_total", {"status": "200"})
        serve.signal(signal.SIGTERM)
        assert wait_for(lambda: serve.returncode is not None, timeout=30, what="serve to exit") is not None
    assert serve.returncode == 0


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_text: Path
) -> Iterator[tuple[RuntimeProcess, RuntimeProcess]]:
    """A stage process and a gateway process started from one pipeline file."""
    env = runtime_env(model_cache, OMNIMODEL_HEALTH_INTERVAL=0.5)
    with split_deployment(PIPELINE, tmp_path_factory.mktemp("deployment"), env) as procs:
        yield procs["llm"], procs["gateway"]


@pytest.mark.slow
def test_stage_and_gateway_processes_serve_the_openai_api(deployment: tuple[RuntimeProcess, RuntimeProcess]) -> None:
    stage, gateway = deployment
    _check_openai_api(gateway.url)
    metrics = stage.get("/metrics")
    assert metrics is not None
    assert (metric_value(metrics.text, "omnimodel_stage_requests_total", {"outcome": "ok"}) or 0) >= 4
    assert metric_value(metrics.text, "omnimodel_queue_depth", {"stage": "llm"}) == 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_a_client_that_goes_away_cancels_the_work_on_the_stage(
    deployment: tuple[RuntimeProcess, RuntimeProcess], stream: bool
) -> None:
    stage, gateway = deployment

    def cancelled() -> float:
        resp = stage.get("/metrics")
        assert resp is not None
        return metric_value(resp.text, "omnimodel_stage_requests_total", {"outcome": "cancelled"}) or 0.0

    def in_flight() -> float | None:
        resp = stage.get("/metrics")
        return None if resp is None else metric_value(resp.text, "omnimodel_requests_in_flight", {"stage": "llm"})

    before = cancelled()
    body = {"model": "text", "messages": USER, "stream": stream, **LONG}
    if stream:
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as resp:
            lines = (line for line in resp.iter_lines() if line)
            for _ in range(3):
                assert next(lines).startswith("data: {")
    else:
        # The client gives up waiting for the full answer (thousands of tokens away).
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    # The connection is closed now, long before the answer is complete: the stage must stop generating.
    wait_for(lambda: cancelled() == before + 1, timeout=10, what="the stage to count the request as cancelled")
    wait_for(lambda: in_flight() == 0, timeout=10, what="the stage to have nothing in flight")


@pytest.fixture(scope="module")
def gateway_only(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_text: Path
) -> Iterator[tuple[RuntimeProcess, Path]]:
    """A gateway whose stage each test starts (and kills) itself; yields the gateway and pipeline file."""
    tmp = tmp_path_factory.mktemp("gateway-only")
    path = pipeline_file(PIPELINE, {"llm": (free_port(),)}, tmp / "pipeline.json")
    gateway = gateway_process(path, log_dir=tmp, env=runtime_env(model_cache, OMNIMODEL_HEALTH_INTERVAL=0.5))
    with running(gateway):
        wait_for(lambda: gateway.get("/livez"), timeout=60, what="the gateway to answer /livez")
        yield gateway, path


def _stage_for(gateway: RuntimeProcess, path: Path, model_cache: Path) -> RuntimeProcess:
    port = int(json.loads(path.read_text())["stages"][0]["endpoints"][0].rsplit(":", 1)[1])
    return stage_process(path, "llm", port, log_dir=path.parent, env=runtime_env(model_cache))


@contextmanager
def _serving_stage(
    gateway: RuntimeProcess, path: Path, model_cache: Path, *, again: str = ""
) -> Iterator[RuntimeProcess]:
    """The gateway's stage process, running and in the gateway's pool."""
    with running(_stage_for(gateway, path, model_cache)) as (stage,):
        stage.wait_healthy()
        wait_for(lambda: _gateway_health(gateway) == 200, timeout=30, what="gateway /health 200")
        yield stage


def _gateway_health(gateway: RuntimeProcess) -> int:
    resp = gateway.get("/health")
    return 0 if resp is None else resp.status_code


@pytest.mark.slow
def test_killed_stage_fails_requests_fast_and_recovers_after_restart(
    gateway_only: tuple[RuntimeProcess, Path], model_cache: Path
) -> None:
    gateway, path = gateway_only
    with _serving_stage(gateway, path, model_cache) as stage:
        # A non-streamed request in flight when the stage dies: a 5xx within seconds, not a hang.
        outcome: dict[str, object] = {}

        def call() -> None:
            started = time.monotonic()
            resp = httpx.post(
                f"{gateway.url}/v1/chat/completions", json={"model": "text", "messages": USER, **LONG}, timeout=60
            )
            outcome.update(status=resp.status_code, body=resp.json(), seconds=time.monotonic() - started)

        caller = threading.Thread(target=call)
        caller.start()

        def in_flight() -> bool:
            resp = stage.get("/metrics")
            return resp is not None and metric_value(resp.text, "omnimodel_requests_in_flight", {"stage": "llm"}) == 1

        wait_for(in_flight, timeout=30, what="the request to reach the stage")
        killed_at = time.monotonic()
        stage.kill()
        caller.join(timeout=30)
        assert not caller.is_alive()
        # "Within a few seconds": a hang would sit until the 120 s stage read timeout.
        assert time.monotonic() - killed_at < 10
        assert outcome["status"] in (502, 503)
        error = outcome["body"]["error"]  # type: ignore[index]
        assert "stage 'llm'" in error["message"]

        # The gateway reports the loss, and new requests fail fast with 503.
        wait_for(lambda: _gateway_health(gateway) == 503, timeout=10, what="gateway /health 503")
        assert (gateway.get("/livez") or httpx.Response(0)).status_code == 200  # not restarted for it
        started = time.monotonic()
        resp = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "text", "messages": USER}, timeout=30)
        assert resp.status_code == 503
        assert time.monotonic() - started < 10

    # The stage comes back on the same address: the gateway uses it again.
    with _serving_stage(gateway, path, model_cache, again=" again"):
        reply = openai_client(gateway.url, timeout=60).chat.completions.create(
            model="text", messages=USER, max_tokens=8
        )  # type: ignore[arg-type]
        assert reply.choices[0].message.content


@pytest.mark.slow
def test_killed_stage_mid_stream_ends_the_stream_with_an_error_chunk(
    gateway_only: tuple[RuntimeProcess, Path], model_cache: Path
) -> None:
    gateway, path = gateway_only
    with _serving_stage(gateway, path, model_cache) as stage:
        body = {"model": "text", "messages": USER, "stream": True, **LONG}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = (line for line in resp.iter_lines() if line)
            assert next(lines).startswith("data: {")
            stage.kill()
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])
        assert "lost the connection to stage 'llm'" in error["error"]["message"]


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_before_the_stage_exits(
    gateway_only: tuple[RuntimeProcess, Path], model_cache: Path
) -> None:
    gateway, path = gateway_only
    with _serving_stage(gateway, path, model_cache) as stage:
        body = {
            "model": "text",
            "messages": USER,
            "stream": True,
            "max_tokens": 300,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as resp:
            lines = (line for line in resp.iter_lines() if line)
            assert next(lines).startswith("data: {")
            stage.signal(signal.SIGTERM)
            rest = list(lines)
        chunks = [json.loads(line[len("data: ") :]) for line in rest[:-1]]
        assert rest[-1] == "data: [DONE]"
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        wait_for(lambda: stage.returncode is not None, timeout=30, what="the stage to exit after draining")
        assert stage.returncode == 0
