"""Gateway -> stage over the frame protocol (RemoteStage + stage server): stage servers on loopback, the
gateway reached in memory through ASGI."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import numpy as np
import pytest
from aiohttp.abc import AbstractResolver, ResolveResult
from fastapi import FastAPI
from runtime_fakes import (
    FakeEngine,
    asgi_client,
    fake_context,
    lifespan,
    omni_pipeline,
    serve_on_loopback,
    text_pipeline,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from yarl import URL

from omnimodel_runtime.gateway import build_app
from omnimodel_runtime.pipeline import Pipeline
from omnimodel_runtime.protocol.frames import MEDIA_TYPE, decode_frames, encode_frame_bytes, encode_frames
from omnimodel_runtime.protocol.stage import (
    GENERATE_PATH,
    ErrorFrame,
    FinalFrame,
    RequestFrame,
    ResponseFrame,
    StageInput,
    StageRequest,
    TensorFrame,
    TextFrame,
    Usage,
)
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.remote import RemoteStage
from omnimodel_runtime.stage.server import build_stage_app
from omnimodel_testbed.procs import apoll

USER = [{"role": "user", "content": "hello there"}]


class Router(AbstractResolver):
    """The gateway's name service: each made-up stage address (``stage-a:8001``) resolves to the loopback
    server that serves it; an unknown one to a loopback port that refuses connections (bound, never
    listening)."""

    def __init__(self) -> None:
        self.ports: dict[str, int] = {}
        self._refusing = socket.socket()
        self._refusing.bind(("127.0.0.1", 0))

    def add(self, url: str, served: str) -> None:
        """Route ``url``'s host and port to the server at ``served``."""
        self.ports[URL(url).raw_authority] = URL(served).port or 80

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        real = self.ports.get(f"{host}:{port}", self._refusing.getsockname()[1])
        return [
            ResolveResult(
                hostname=host, host="127.0.0.1", port=real, family=socket.AF_INET, proto=0, flags=socket.AI_NUMERICHOST
            )
        ]

    async def close(self) -> None:
        self._refusing.close()


class Cluster:
    """Stage servers with fake engines on loopback, known to the gateway by made-up addresses (``Router``)."""

    def __init__(self, endpoints: tuple[str, ...], *, live: tuple[str, ...] | None = None) -> None:
        self.settings = RuntimeSettings(health_interval=3600)
        self.pipeline = text_pipeline(endpoints=endpoints)
        self.router = Router()
        self.engines: dict[str, FakeEngine] = {}
        self.stage_apps: dict[str, FastAPI] = {}
        stage = self.pipeline.entry
        for url in live if live is not None else endpoints:
            engine = FakeEngine(fake_context(stage))
            self.stage_apps[url] = build_stage_app(self.settings, self.pipeline, stage.name, engine=engine)
            self.engines[url] = engine
        self.remote = RemoteStage(stage, self.settings, resolver=self.router)
        handles: dict[str, StageHandle] = {stage.name: self.remote}
        self.gateway = build_app(self.settings, self.pipeline, handles)

    async def serve(self, url: str, app: FastAPI, stack: AsyncExitStack, *, wait: bool = True) -> None:
        """Serve ``app`` on loopback as the stage endpoint ``url``."""
        self.router.add(url, await serve_on_loopback(app, stack, wait=wait))

    @asynccontextmanager
    async def running(self, *, warm: tuple[str, ...] | None = None) -> AsyncIterator[httpx.AsyncClient]:
        """Every stage server up (those not in ``warm``, when given, still warming), then the gateway."""
        async with AsyncExitStack() as stack:
            stack.push_async_callback(self.router.close)
            for url, app in self.stage_apps.items():
                await self.serve(url, app, stack, wait=warm is None or url in warm)
            await stack.enter_async_context(lifespan(self.gateway))
            yield await stack.enter_async_context(asgi_client(self.gateway))


async def test_chat_through_a_remote_stage_matches_the_in_process_answer() -> None:
    cluster = Cluster(("http://stage-a:8001",))
    async with cluster.running() as http:
        resp = await http.post(
            "/v1/chat/completions", json={"model": "text", "messages": USER, "max_tokens": 3, "seed": 5}
        )
        assert resp.status_code == 200
        body = resp.json()
        assert body["choices"][0]["message"]["content"] == " w0 w1 w2"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        (inp,) = cluster.engines["http://stage-a:8001"].requests
        assert inp.request.messages == ({"role": "user", "content": "hello there"},)
        assert (inp.request.sampling.max_tokens, inp.request.sampling.seed) == (3, 5)
        health = (await http.get("/health")).json()
        assert health["stages"]["llm"]["endpoints"][0]["healthy"] is True


async def test_engine_rejections_cross_the_wire_with_their_status() -> None:
    cluster = Cluster(("http://stage-a:8001",))
    async with cluster.running() as http:
        resp = await http.post(
            "/v1/chat/completions", json={"model": "text", "messages": [{"role": "user", "content": "REJECT"}]}
        )
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == "the prompt does not fit"
        assert resp.json()["error"]["param"] == "messages"


async def test_requests_go_to_the_endpoint_with_fewest_in_flight() -> None:
    a, b = "http://stage-a:8001", "http://stage-b:8001"
    cluster = Cluster((a, b))
    async with cluster.running() as http:
        held = {"model": "text", "messages": [{"role": "user", "content": "HOLD"}], "max_tokens": 2}
        first = asyncio.create_task(http.post("/v1/chat/completions", json=held))
        await apoll(
            lambda: any(e.requests for e in cluster.engines.values()), timeout=5, what="a stage took the request"
        )
        busy = next(url for url, e in cluster.engines.items() if e.requests)
        idle = b if busy == a else a
        second = asyncio.create_task(http.post("/v1/chat/completions", json=held))
        await apoll(lambda: bool(cluster.engines[idle].requests), timeout=5, what="the idle stage took one")
        assert len(cluster.engines[busy].requests) == 1
        for engine in cluster.engines.values():
            engine.release.set()
        assert (await first).status_code == 200
        assert (await second).status_code == 200
        assert all(e.in_flight == 0 for e in cluster.remote.endpoints)


async def test_a_refused_endpoint_fails_over_and_is_marked_unhealthy() -> None:
    dead, alive = "http://stage-dead:8001", "http://stage-b:8001"
    cluster = Cluster((dead, alive), live=(alive,))
    async with cluster.running() as http:
        for _ in range(3):
            resp = await http.post("/v1/chat/completions", json={"model": "text", "messages": USER})
            assert resp.status_code == 200
        assert len(cluster.engines[alive].requests) == 3
        endpoints = {e["url"]: e for e in (await http.get("/health")).json()["stages"]["llm"]["endpoints"]}
        assert endpoints[dead]["healthy"] is False
        assert "Cannot connect to host stage-dead:8001" in endpoints[dead]["error"]
        # The gateway is still healthy: the stage has a healthy endpoint.
        assert (await http.get("/health")).status_code == 200


async def test_no_reachable_endpoint_is_a_fast_503_naming_the_stage() -> None:
    cluster = Cluster(("http://stage-a:8001", "http://stage-b:8001"), live=())
    async with cluster.running() as http:
        assert (await http.get("/health")).status_code == 503
        started = time.monotonic()
        resp = await http.post("/v1/chat/completions", json={"model": "text", "messages": USER})
        assert resp.status_code == 503
        # Refused connections fail at once; the bound only catches a retry loop or a hang.
        assert time.monotonic() - started < 5
        message = resp.json()["error"]["message"]
        assert "stage 'llm' is unavailable" in message
        assert "stage-a" in message
        assert "stage-b" in message


async def test_a_stage_that_is_still_warming_answers_503_and_is_skipped() -> None:
    warm, cold = "http://stage-warm:8001", "http://stage-cold:8001"
    cluster = Cluster((warm, cold))
    gate = asyncio.Event()
    cluster.engines[cold].gate = gate
    async with cluster.running(warm=(warm,)) as http:
        async with asgi_client(cluster.stage_apps[cold]) as stage_http:
            assert (await stage_http.get("/health")).status_code == 503
            assert (await stage_http.get("/livez")).status_code == 200
        for _ in range(4):
            assert (
                await http.post("/v1/chat/completions", json={"model": "text", "messages": USER})
            ).status_code == 200
        assert len(cluster.engines[warm].requests) == 4
        assert cluster.engines[cold].requests == []
        gate.set()


async def test_stage_server_streams_frames_and_passes_request_tensors() -> None:
    pipeline = text_pipeline()
    engine = FakeEngine(fake_context(pipeline.entry))
    app = build_stage_app(RuntimeSettings(), pipeline, "llm", engine=engine)
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)
    body = encode_frame_bytes(
        RequestFrame(request=StageRequest(request_id="t1", prompt="a b c"), tensors={"hidden": hidden})
    )
    async with lifespan(app), asgi_client(app) as http:
        resp = await http.post("/v1/stage/generate", content=body, headers={"content-type": MEDIA_TYPE})
        assert resp.status_code == 200
        assert resp.headers["content-type"] == MEDIA_TYPE
        frames = decode_frames(resp.content)
        assert frames[0] == TextFrame(" w0", (100,))
        assert frames[-1] == FinalFrame("length", Usage(3, 5))
        np.testing.assert_array_equal(engine.requests[0].tensors["hidden"], hidden)
        metrics = (await http.get("/metrics")).text
        assert 'omnimodel_stage_requests_total{outcome="ok",stage="llm"} 1.0' in metrics
        assert 'omnimodel_requests_in_flight{stage="llm"} 0.0' in metrics
        assert 'omnimodel_queue_depth{stage="llm"} 0.0' in metrics


def _request_frame(data: dict[str, object]) -> bytes:
    """A request frame with a header of our own making (what a caller other than our gateway may send)."""
    header = json.dumps({"kind": "request", "data": data, "tensors": [], "payload": 0}).encode()
    return struct.pack(">I", len(header)) + header


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "empty request body"),
        (b"\x00\x00\x00\x05{nope", "malformed request body"),
        (encode_frame_bytes(TextFrame("x")), "must start with a request frame"),
        # Stage parameters out of their bounds: refused naming the field, before any engine sees them.
        (_request_frame({"request_id": "r", "params": {"image": {"n": 0}}}), "params.image.n"),
        (_request_frame({"request_id": "r", "params": {"reply_ids": ["a"]}}), "params.reply_ids"),
        (_request_frame({"request_id": "r", "params": {"speak": True, "typo": 1}}), "params.typo"),
    ],
)
async def test_stage_server_refuses_bad_bodies_with_a_400_error_frame(body: bytes, match: str) -> None:
    pipeline = text_pipeline()
    app = build_stage_app(RuntimeSettings(), pipeline, "llm", engine=FakeEngine(fake_context(pipeline.entry)))
    async with lifespan(app), asgi_client(app) as http:
        resp = await http.post("/v1/stage/generate", content=body)
        assert resp.status_code == 400
        (frame,) = decode_frames(resp.content)
        assert isinstance(frame, ErrorFrame)
        assert match in frame.message


class UpstreamEcho(FakeEngine):
    """A downstream stage: reports the upstream frames it consumed while they streamed in."""

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        assert inp.upstream is not None
        rows = 0
        async for frame in inp.upstream:
            if isinstance(frame, TensorFrame):
                rows += int(frame.tensors["row"].shape[0])
                yield TextFrame(text=f"got {rows}")
        yield FinalFrame("stop", Usage(0, rows))


async def test_a_downstream_stage_consumes_frames_streamed_in_its_request_body() -> None:
    pipeline: Pipeline = omni_pipeline()
    talker = pipeline.stage("talker")
    app = build_stage_app(RuntimeSettings(), pipeline, "talker", engine=UpstreamEcho(fake_context(talker)))

    async def body() -> AsyncIterator[bytes]:
        yield encode_frame_bytes(RequestFrame(request=StageRequest(request_id="t", prompt="x")))
        for _ in range(3):
            yield encode_frame_bytes(TensorFrame(tensors={"row": np.zeros((2, 8), dtype=np.float32)}))

    async with lifespan(app), asgi_client(app) as http:
        resp = await http.post("/v1/stage/generate", content=body())
        frames = decode_frames(resp.content)
        assert [f.text for f in frames if isinstance(f, TextFrame)] == ["got 2", "got 4", "got 6"]
        assert frames[-1] == FinalFrame("stop", Usage(0, 6))


async def test_remote_stage_turns_a_truncated_stream_into_a_502() -> None:
    stage = text_pipeline().entry
    truncated = encode_frames([TextFrame(" w0", (1,))])

    async def health(_: Request) -> Response:
        return Response()

    async def generate(_: Request) -> Response:
        return Response(truncated, media_type=MEDIA_TYPE)

    app = Starlette(routes=[Route("/health", health), Route(GENERATE_PATH, generate, methods=["POST"])])
    async with AsyncExitStack() as stack:
        url = await serve_on_loopback(app, stack, wait=False)  # type: ignore[arg-type]
        remote = RemoteStage(stage, RuntimeSettings(), endpoints=(url,))
        await remote.start()
        stack.push_async_callback(remote.stop)
        frames = remote.generate(StageInput(request=StageRequest(request_id="x", prompt="p")))
        assert await anext(frames) == TextFrame(" w0", (1,))
        with pytest.raises(Exception, match="without a final frame") as info:
            await anext(frames)
        assert getattr(info.value, "status", None) == 502


async def test_hostnames_expand_to_one_endpoint_per_address_and_keep_their_state() -> None:
    """A headless Service name resolves to every ready pod; each becomes an endpoint of its own."""
    settings = RuntimeSettings(health_interval=3600, connect_timeout=0.5)
    pipeline = text_pipeline(
        endpoints=("http://localhost:8123", "http://10.1.2.3:8001", "http://no-such-host.invalid:1")
    )
    remote = RemoteStage(pipeline.entry, settings)
    await remote.resolve_endpoints()
    urls = [e.url for e in remote.endpoints]
    assert "http://127.0.0.1:8123" in urls
    assert "http://localhost:8123" not in urls
    assert "http://10.1.2.3:8001" in urls  # an address stays as it is
    assert "http://no-such-host.invalid:1" in urls  # an unresolvable name is kept, not dropped
    kept = next(e for e in remote.endpoints if e.url == "http://127.0.0.1:8123")
    kept.in_flight = 3
    await remote.resolve_endpoints()
    assert next(e for e in remote.endpoints if e.url == "http://127.0.0.1:8123") is kept


def test_per_stage_timeouts_override_the_process_wide_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIMODEL_STAGE_TIMEOUTS", '{"denoise": {"read": 900}, "talker": {"health": 3}}')
    monkeypatch.setenv("OMNIMODEL_HEALTH_TIMEOUT", "0.5")
    settings = RuntimeSettings()
    denoise, talker, other = (settings.timeouts_for(s) for s in ("denoise", "talker", "llm"))
    assert (denoise.read, denoise.health, denoise.connect) == (900, 0.5, 3.0)
    assert (talker.read, talker.health) == (120.0, 3)
    assert (other.read, other.health) == (120.0, 0.5)
    monkeypatch.setenv("OMNIMODEL_STAGE_TIMEOUTS", '{"talker": {"helth": 3}}')
    with pytest.raises(ValueError, match="helth"):
        RuntimeSettings()


class WakingCluster(Cluster):
    """The stage listed in stage_wake, its replica not there yet (a stage the autoscaler took to zero)."""

    def __init__(self, wake: float) -> None:
        super().__init__(("http://stage-a:8001",), live=())
        from prometheus_client import CollectorRegistry

        from omnimodel_runtime.metrics import StageTraffic

        self.settings = RuntimeSettings(health_interval=3600, stage_wake={"llm": wake}, resolve_endpoints=False)
        registry = CollectorRegistry()
        self.remote = RemoteStage(
            self.pipeline.entry, self.settings, resolver=self.router, traffic=StageTraffic(registry)
        )
        self.gateway = build_app(self.settings, self.pipeline, {"llm": self.remote}, registry=registry)

    async def replica(self, stack: AsyncExitStack) -> None:
        """Start the stage's first replica at its address."""
        stage = self.pipeline.entry
        app = build_stage_app(self.settings, self.pipeline, stage.name, engine=FakeEngine(fake_context(stage)))
        await self.serve("http://stage-a:8001", app, stack)


def _sample(page: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("stage") == "llm":
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


async def test_a_request_for_a_stage_at_zero_is_held_until_a_replica_answers() -> None:
    cluster = WakingCluster(wake=30)
    async with cluster.running() as http:
        # Nothing to serve, yet ready: the stage wakes on demand.
        assert (await http.get("/health")).status_code == 200
        chat = asyncio.create_task(
            http.post("/v1/chat/completions", json={"model": "text", "messages": USER, "max_tokens": 2})
        )
        held = lambda: cluster.remote.describe()["held"] == 1  # noqa: E731
        await apoll(held, timeout=5, what="the request is held")
        page = (await http.get("/metrics")).text
        assert _sample(page, "omnimodel_gateway_stage_waiting") == 1
        assert _sample(page, "omnimodel_gateway_stage_in_flight") == 0
        assert not chat.done()
        async with AsyncExitStack() as stack:
            await cluster.replica(stack)
            resp = await asyncio.wait_for(chat, 10)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == " w0 w1"
            page = (await http.get("/metrics")).text
            assert _sample(page, "omnimodel_gateway_stage_waiting") == 0
            assert _sample(page, "omnimodel_gateway_stage_in_flight") == 0
            assert _sample(page, "omnimodel_gateway_stage_request_seconds_count") == 1
            # One request was in flight for as long as the stage took it (it was not in flight while held).
            busy = _sample(page, "omnimodel_gateway_stage_busy_seconds_total")
            assert 0 < busy <= _sample(page, "omnimodel_gateway_stage_request_seconds_sum") + 0.05


async def test_a_stage_that_does_not_wake_in_time_fails_the_request_with_a_503_naming_it() -> None:
    cluster = WakingCluster(wake=0.6)
    async with cluster.running() as http:
        began = time.monotonic()
        resp = await http.post("/v1/chat/completions", json={"model": "text", "messages": USER, "max_tokens": 2})
        assert resp.status_code == 503
        assert "stage 'llm' has no ready replica: none woke within 0.6 s" in resp.json()["error"]["message"]
        assert 0.5 < time.monotonic() - began < 5
        assert cluster.remote.describe()["held"] == 0


async def test_a_stage_that_cannot_wake_fails_at_once() -> None:
    """Without stage_wake, no replica means a fast 503 (a crashed stage must not hold requests)."""
    cluster = Cluster(("http://stage-a:8001",), live=())
    async with cluster.running() as http:
        assert (await http.get("/health")).status_code == 503
        began = time.monotonic()
        resp = await http.post("/v1/chat/completions", json={"model": "text", "messages": USER, "max_tokens": 2})
        assert resp.status_code == 503 and time.monotonic() - began < 2
