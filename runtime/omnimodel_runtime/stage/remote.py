"""A stage served by other processes, reached over the frame protocol (``omnimodel gateway``)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from aiohttp.abc import AbstractResolver
from yarl import URL

from omnimodel_runtime.errors import StageError, StageUnavailableError
from omnimodel_runtime.metrics import StageTraffic
from omnimodel_runtime.pipeline import Stage
from omnimodel_runtime.protocol.frames import MEDIA_TYPE, FrameDecoder, FrameError, encode_frame, encode_frame_bytes
from omnimodel_runtime.protocol.stage import (
    GENERATE_PATH,
    INFO_PATH,
    ErrorFrame,
    FinalFrame,
    RequestFrame,
    ResponseFrame,
    StageInfo,
    StageInput,
    StageVoices,
)
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.web.access import REQUEST_ID_HEADER

log = logging.getLogger(__name__)


_HEADERS: Final = {"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}
# Unanswered health probes in a row after which an endpoint counts as hung.
HUNG_AFTER: Final = 2
# While requests are held for a stage at zero: how often its name is resolved and its endpoints probed.
WAKE_POLL: Final = 0.5


@dataclass(eq=False)
class Endpoint:
    """One address of a stage (a pod, once a headless Service name is resolved) as this gateway sees it."""

    url: str
    in_flight: int = 0
    healthy: bool = False
    last_error: str | None = "not checked yet"
    # Requests waiting right now for this endpoint's next bytes (headers or a frame), as timeouts that
    # :meth:`stalled` expires at once.
    waiting: set[asyncio.Timeout] = field(default_factory=set)
    # Health probes in a row that got no answer in time.
    timeouts: int = 0

    @property
    def hung(self) -> bool:
        """Two probes in a row unanswered: the process stopped answering (not just a slow answer)."""
        return self.timeouts >= HUNG_AFTER

    @property
    def generate_url(self) -> str:
        return f"{self.url}{GENERATE_PATH}"

    def stalled(self) -> None:
        """The endpoint stopped answering: every request waiting on it stops waiting now."""
        now = asyncio.get_running_loop().time()
        for timeout in list(self.waiting):
            timeout.reschedule(now)


class _Watch:
    """``async with`` around one wait for an endpoint (response headers, the next chunk): raises
    :class:`_StalledError` when the endpoint is declared stalled meanwhile. Entered per wait, never across
    a ``yield``, so the cancellation that ends the wait can only land inside it."""

    __slots__ = ("_endpoint", "_timeout")

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._timeout = asyncio.timeout(None)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()
        self._endpoint.waiting.add(self._timeout)

    async def __aexit__(self, *exc: Any) -> None:
        self._endpoint.waiting.discard(self._timeout)
        try:
            await self._timeout.__aexit__(*exc)
        except TimeoutError as err:
            if self._timeout.expired():
                raise _StalledError from err
            raise


async def _watched(endpoint: Endpoint, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    it = aiter(chunks)
    while True:
        try:
            async with _Watch(endpoint):
                chunk = await anext(it)
        except StopAsyncIteration:
            return
        yield chunk


class RemoteStage(StageHandle):
    """A stage served by other processes, reached over the frame protocol.

    Balancing: each request goes to the healthy endpoint with the fewest requests in flight from this
    gateway (ties rotate). An unhealthy endpoint is out of the pool: when no healthy one is left, every
    endpoint not known to be hung is probed once more right away (a restart the poller has not seen
    yet), and without an answer the request fails at once with a 503 naming the stage.

    Health is active and passive. Active: every ``health_interval`` each endpoint's ``/health`` is asked,
    with the stage's health timeout; an error, a non-200 or no answer in time takes it out of the pool,
    a 200 brings it back. Two unanswered probes in a row mean the process stopped answering (SIGSTOP, a
    wedged node): the requests waiting on it stop waiting, and one that has received nothing yet fails
    over to another endpoint. Passive: a refused connection, a lost connection or a response silent for
    the read timeout takes the endpoint out of the pool as well. A refused connection fails over at once (no
    request was sent); a connection lost after the response started cannot be retried (tokens already
    went to the client) and fails the request with a 502 that names the stage.

    Waking: a stage listed in ``stage_wake`` may have no replica at all (the operator's autoscaler took
    it to zero). A request for it is then held, not failed: one poller resolves and probes the stage
    every ``WAKE_POLL`` seconds while anything is held, the held count is exported (what wakes the
    stage), and the request goes to the first replica that answers ``/health``, or fails with a 503
    naming the stage after the stage's wake timeout.
    """

    def __init__(
        self,
        stage: Stage,
        settings: RuntimeSettings,
        *,
        endpoints: tuple[str, ...] | None = None,
        resolver: AbstractResolver | None = None,
        traffic: StageTraffic | None = None,
    ) -> None:
        super().__init__(stage)
        urls = endpoints if endpoints is not None else stage.endpoints
        if not urls:
            raise ValueError(f"stage {stage.name!r} has no endpoints in the pipeline file")
        self.endpoints = [Endpoint(url.rstrip("/")) for url in urls]
        # What the pipeline file names; ``endpoints`` is what they currently resolve to.
        self._configured = tuple(url.rstrip("/") for url in urls)
        self._settings = settings
        self._timeouts = settings.timeouts_for(stage.name)
        # How the connector turns a host into addresses (tests map made-up hosts onto loopback servers).
        self._resolver = resolver
        # One client for everything sent to the stage. aiohttp, because a downstream stage's request body
        # is its upstream's output as it is produced: aiohttp writes the body from its own task while the
        # response is read (full duplex), where httpx (httpcore) sends the whole body first, so a talker
        # could only start once its thinker had finished. It also streams responses and pools keep-alive
        # connections per endpoint, and sets TCP_NODELAY on each (frames are small and latency-bound).
        self._client: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._rotation = itertools.count()
        self._traffic = traffic
        if traffic is not None:
            traffic.known(stage.name)
        self._wake = settings.stage_wake.get(stage.name)
        self._held = 0
        self._waker: asyncio.Task[None] | None = None
        self._probed = asyncio.Condition()

    async def start(self) -> None:
        t = self._timeouts
        self._client = aiohttp.ClientSession(
            # No bound on a whole request (a generation takes as long as it takes): the connect and the
            # silence between two reads are bounded instead.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect, sock_read=t.read),
            # A name is looked up on every new connection, never from a cache: a stage's pods come and go.
            connector=aiohttp.TCPConnector(
                limit=0, resolver=self._resolver, use_dns_cache=False, enable_cleanup_closed=True
            ),
            # The pipeline file names the stage's address; a proxy from the environment has no say.
            trust_env=False,
            auto_decompress=False,
        )
        await self.check_health()
        self._poller = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        for task in (self._poller, self._waker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def ready(self) -> bool:
        # A stage that may sit at zero serves on demand: its requests are held while it wakes.
        return self._wake is not None or any(e.healthy for e in self.endpoints)

    def describe(self) -> dict[str, Any]:
        wake = {"wake_timeout": self._wake, "held": self._held} if self._wake is not None else {}
        return {
            "ready": self.ready,
            "mode": "remote",
            **wake,
            "endpoints": [
                {"url": e.url, "healthy": e.healthy, "in_flight": e.in_flight, "error": e.last_error}
                for e in self.endpoints
            ],
        }

    async def check_health(self) -> None:
        """Probe every endpoint's ``/health`` once (concurrently)."""
        await asyncio.gather(*(self._probe(e) for e in self.endpoints))

    async def _probe(self, endpoint: Endpoint) -> None:
        assert self._client is not None
        timeout = self._timeouts.health
        try:
            async with self._client.get(f"{endpoint.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                status = resp.status
        except TimeoutError:
            # Accepted (or queued) but not answered. Once: out of the pool (a CPU-starved process may just
            # be slow). Twice in a row: a hung process; waiting longer on it helps nobody.
            endpoint.timeouts += 1
            self._mark(endpoint, healthy=False, error=f"/health did not answer within {timeout:g} s")
            if endpoint.hung:
                endpoint.stalled()
            return
        except aiohttp.ClientError as err:
            endpoint.timeouts = 0
            self._mark(endpoint, healthy=False, error=f"{type(err).__name__}: {err}")
            return
        endpoint.timeouts = 0
        if status == 200:
            self._mark(endpoint, healthy=True, error=None)
        else:
            self._mark(endpoint, healthy=False, error=f"/health answered {status}")

    def _mark(self, endpoint: Endpoint, *, healthy: bool, error: str | None) -> None:
        if endpoint.healthy != healthy:
            log.info(
                "Stage %s endpoint %s became %s%s",
                self.name,
                endpoint.url,
                "healthy" if healthy else "unhealthy",
                f" ({error})" if error else "",
            )
        endpoint.healthy, endpoint.last_error = healthy, error

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._settings.health_interval)
            if self._settings.resolve_endpoints:
                await self.resolve_endpoints()
            await self.check_health()

    async def resolve_endpoints(self) -> None:
        """Expand each configured URL to one endpoint per address its host resolves to.

        The operator gives every stage a headless Service, whose DNS name resolves to the addresses of
        all ready pods: balancing per pod (fewest in flight) needs those, not one virtual IP. Pods come
        and go, so this runs on every health poll; an endpoint keeps its in-flight count and health while
        its address stays. A name that does not resolve (a static URL, a DNS outage) is kept as it is.
        """
        loop = asyncio.get_running_loop()
        wanted: list[str] = []
        for url in self._configured:
            parsed = URL(url)
            host, port = parsed.host or "", parsed.port or (443 if parsed.scheme == "https" else 80)
            if _is_ip(host):
                wanted.append(url)
                continue
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), self._timeouts.connect
                )
            except (OSError, TimeoutError):
                wanted.append(url)
                continue
            addresses = sorted({str(info[4][0]) for info in infos})
            wanted.extend(str(parsed.with_host(addr)).rstrip("/") for addr in addresses)
        current = {e.url: e for e in self.endpoints}
        if list(current) != wanted:
            log.info("Stage %s endpoints: %s", self.name, ", ".join(wanted))
            self.endpoints = [current.get(url) or Endpoint(url) for url in wanted]

    def _pick(self, exclude: set[str]) -> Endpoint | None:
        """The healthy endpoint with the fewest requests in flight (ties rotate), leaving out ``exclude``."""
        turn = next(self._rotation)
        n = len(self.endpoints)
        rotated = [self.endpoints[(turn + i) % n] for i in range(n)]
        healthy = [e for e in rotated if e.healthy and e.url not in exclude]
        # min() keeps the first of equals: ties go in rotated order.
        return min(healthy, key=lambda e: e.in_flight, default=None)

    async def _choose(self, exclude: set[str], failures: list[str]) -> Endpoint:
        """An endpoint for the next attempt, or a 503 naming the stage and why each endpoint is out."""
        endpoint = self._pick(exclude)
        if endpoint is None:
            # Nothing healthy: ask once more now (a restart the poller has not seen yet), bounded by the
            # health timeout, rather than send the request where it would hang or be refused. A hung one
            # was asked less than a poll interval ago.
            again = [e for e in self.endpoints if e.url not in exclude and not e.hung]
            await asyncio.gather(*(self._probe(e) for e in again))
            endpoint = self._pick(exclude)
        if endpoint is None and self._wake is not None and not exclude:
            endpoint = await self._hold(self._wake)
            if endpoint is None:
                reasons = [f"{e.url}: {e.last_error}" for e in self.endpoints]
                raise StageUnavailableError(
                    f"stage {self.name!r} has no ready replica: none woke within {self._wake:g} s "
                    f"({'; '.join(reasons)})"
                )
        if endpoint is None:
            reasons = [*failures, *(f"{e.url}: {e.last_error}" for e in self.endpoints if e.url not in exclude)]
            raise StageUnavailableError(f"stage {self.name!r} is unavailable ({'; '.join(reasons)})")
        return endpoint

    async def _hold(self, wake: float) -> Endpoint | None:
        """Wait up to ``wake`` seconds for a healthy endpoint (a stage at zero waking up), counted as held."""
        self._held += 1
        self._report_held()
        if self._held == 1:
            log.info("Stage %s has no ready replica: holding requests up to %g s while it wakes", self.name, wake)
        if self._waker is None or self._waker.done():
            self._waker = asyncio.create_task(self._wake_poll())
        try:
            async with asyncio.timeout(wake), self._probed:
                while (endpoint := self._pick(set())) is None:
                    await self._probed.wait()
                return endpoint
        except TimeoutError:
            return None
        finally:
            self._held -= 1
            self._report_held()

    async def _wake_poll(self) -> None:
        """While requests are held: resolve and probe the stage, then let the held requests look."""
        while self._held:
            await asyncio.sleep(WAKE_POLL)
            if self._settings.resolve_endpoints:
                await self.resolve_endpoints()
            await self.check_health()
            async with self._probed:
                self._probed.notify_all()

    def _report_held(self) -> None:
        if self._traffic is not None:
            self._traffic.waiting(self.name, self._held)

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        if self._client is None:
            raise StageUnavailableError(f"stage {self.name!r} client is not started")
        head = encode_frame_bytes(RequestFrame(request=inp.request, tensors=inp.tensors))
        headers = {**_HEADERS, REQUEST_ID_HEADER: inp.request.request_id}
        # A downstream stage's body is the request frame followed by the upstream stage's frames as they
        # are produced, so it starts before the upstream one has finished. That stream can be consumed
        # once: exactly one attempt. A request with a body of its own may go to another endpoint while
        # nothing of it has reached the caller.
        retry = inp.upstream is None
        failures: list[str] = []
        tried: set[str] = set()
        stale_retried: set[str] = set()
        while True:
            endpoint = await self._choose(tried, failures)
            body = head if inp.upstream is None else _streamed_body(head, inp.upstream)
            sent = self._sent(endpoint)
            started = done = False
            try:
                async for frame in self._stream(endpoint, body, headers, retry=retry):
                    started = True
                    # The caller may stop reading at the final frame: that is the end of the work.
                    done = done or isinstance(frame, FinalFrame)
                    yield frame
                return
            except _RetryableError as err:
                # Raised only before the stage produced anything, so nothing reached the caller.
                assert not started
                failures.append(f"{endpoint.url}: {err}")
                # A second try on the same endpoint only after a stale pooled connection.
                if not str(err).endswith(_STALE) or endpoint.url in stale_retried:
                    tried.add(endpoint.url)
                stale_retried.add(endpoint.url)
            finally:
                self._finished(endpoint, sent if done else None)

    async def voices(self) -> StageVoices | None:
        """Asked of the first healthy endpoint's ``/v1/stage/info`` (every replica serves the same model)."""
        if self._client is None:
            raise StageUnavailableError(f"stage {self.name!r} client is not started")
        endpoint = await self._choose(set(), [])
        try:
            async with self._client.get(
                f"{endpoint.url}{INFO_PATH}", timeout=aiohttp.ClientTimeout(total=self._timeouts.health)
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as err:
            raise StageUnavailableError(
                f"stage {self.name!r} is unavailable ({endpoint.url}: {type(err).__name__} on {INFO_PATH})"
            ) from err
        if status != 200:
            raise StageError(f"stage {self.name!r} answered {INFO_PATH} with HTTP {status}", status=502)
        return StageInfo.model_validate_json(raw).voices

    def _sent(self, endpoint: Endpoint) -> float:
        """Count an attempt as in flight (on the endpoint, for balancing; on the stage, for autoscaling)."""
        endpoint.in_flight += 1
        if self._traffic is not None:
            self._traffic.sent(self.name)
        return time.monotonic()

    def _finished(self, endpoint: Endpoint, sent: float | None) -> None:
        """``sent`` is the attempt's start when it completed, None when it failed or was cancelled."""
        endpoint.in_flight -= 1
        if self._traffic is not None:
            self._traffic.finished(self.name, None if sent is None else time.monotonic() - sent)

    async def _frames(self, endpoint: Endpoint, chunks: AsyncIterator[bytes]) -> AsyncGenerator[ResponseFrame, None]:
        """The frames of a stage's 200 response, up to its final one; an error frame is raised."""
        decoder = FrameDecoder(max_frame_bytes=self._settings.stage_max_body_bytes)
        async for chunk in chunks:
            for frame in decoder.feed(chunk):
                if isinstance(frame, ErrorFrame):
                    raise frame.to_error()
                if isinstance(frame, RequestFrame):
                    raise FrameError("a stage answered with a request frame")
                yield frame
                if isinstance(frame, FinalFrame):
                    return
        raise StageError(f"stage {self.name!r} at {endpoint.url} ended its response without a final frame", status=502)

    async def _stream(
        self, endpoint: Endpoint, body: bytes | AsyncIterator[bytes], headers: dict[str, str], *, retry: bool
    ) -> AsyncIterator[ResponseFrame]:
        """One attempt at ``endpoint``. With ``retry``, a failure before the stage produced anything is
        :class:`_RetryableError` (the caller may try another endpoint); without, it is the request's error."""
        assert self._client is not None
        responded = yielded = False
        try:
            async with _Watch(endpoint):
                # A body still being produced goes chunked; a whole one with its length.
                chunked = None if isinstance(body, bytes) else True
                resp = await self._client.post(endpoint.generate_url, data=body, headers=headers, chunked=chunked)
            async with resp:
                responded = True
                if resp.status == 503 and retry:
                    await resp.read()
                    self._mark(endpoint, healthy=False, error="stage answered 503 (not ready)")
                    raise _RetryableError("not ready (503)")
                if resp.status != 200:
                    raw = await resp.read()
                    raise _error_from_body(self.name, resp.status, resp.headers.get("content-type", ""), raw)
                chunks = _watched(endpoint, resp.content.iter_any())
                async with contextlib.aclosing(self._frames(endpoint, chunks)) as frames:
                    async for frame in frames:
                        yielded = True
                        yield frame
        except _StalledError as err:
            if retry and not yielded:
                # Nothing reached the caller: another endpoint can still answer the whole request.
                raise _RetryableError("stopped answering (its /health timed out)") from err
            raise self._stopped_answering(endpoint) from err
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as err:
            # No connection, so no request ran.
            self._mark(endpoint, healthy=False, error=f"{type(err).__name__}: {err}")
            if retry:
                raise _RetryableError(f"cannot connect ({type(err).__name__})") from err
            raise StageUnavailableError(f"stage {self.name!r} is unavailable ({endpoint.url}: {err})") from err
        except TimeoutError as err:
            raise self._silent(endpoint) from err
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as err:
            if retry and not responded:
                # Typically a pooled keep-alive connection the stage had closed (e.g. a restart): the
                # request never ran, so another attempt is safe. A dead stage then refuses the connect.
                raise _RetryableError(f"{type(err).__name__}: {_STALE}") from err
            raise self._lost(endpoint, err) from err
        except FrameError as err:
            raise self._malformed(endpoint, err) from err

    # What went wrong mid-response.

    def _silent(self, endpoint: Endpoint) -> StageError:
        # A stalled stream: the endpoint leaves the pool until its /health answers again.
        silence = f"sent nothing for {self._timeouts.read:g} s"
        self._mark(endpoint, healthy=False, error=silence)
        return StageError(f"stage {self.name!r} at {endpoint.url} {silence}", status=504, type="timeout")

    def _stopped_answering(self, endpoint: Endpoint) -> StageError:
        return StageError(
            f"stage {self.name!r} at {endpoint.url} stopped answering mid-request (its /health timed out)",
            status=503,
            type="service_unavailable",
        )

    def _lost(self, endpoint: Endpoint, err: Exception) -> StageError:
        self._mark(endpoint, healthy=False, error=f"{type(err).__name__}: {err}")
        return StageError(
            f"lost the connection to stage {self.name!r} at {endpoint.url} mid-request ({type(err).__name__})",
            status=502,
            type="bad_gateway",
        )

    def _malformed(self, endpoint: Endpoint, err: FrameError) -> StageError:
        return StageError(f"stage {self.name!r} at {endpoint.url} sent a malformed frame: {err}", status=502)


def _error_from_body(stage: str, status: int, content_type: str, raw: bytes) -> StageError:
    """A stage's non-200 answer as an error: its own ErrorFrame when it sent one."""
    if content_type.startswith(MEDIA_TYPE):
        with contextlib.suppress(FrameError):
            for frame in FrameDecoder().feed(raw):
                if isinstance(frame, ErrorFrame):
                    return frame.to_error()
    message = raw[:500].decode(errors="replace")
    return StageError(f"stage {stage!r} answered HTTP {status}: {message}", status=502)


_STALE = "connection dropped before a response"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _streamed_body(head: bytes, upstream: AsyncIterator[ResponseFrame]) -> AsyncIterator[bytes]:
    yield head
    async for frame in upstream:
        for part in encode_frame(frame):
            yield bytes(part)


class _RetryableError(Exception):
    """Nothing reached the caller; another endpoint may take the request."""


class _StalledError(Exception):
    """The endpoint was declared stalled while a request waited on it."""
