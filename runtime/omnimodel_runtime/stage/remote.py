"""A stage served by other processes, reached over the frame protocol (``omnimodel gateway``)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import httpx

from omnimodel_runtime.errors import StageError, StageUnavailableError
from omnimodel_runtime.pipeline import Stage
from omnimodel_runtime.protocol.frames import MEDIA_TYPE, FrameDecoder, FrameError, encode_frame, encode_frame_bytes
from omnimodel_runtime.protocol.stage import (
    GENERATE_PATH,
    ErrorFrame,
    FinalFrame,
    RequestFrame,
    ResponseFrame,
    StageInput,
)
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle

log = logging.getLogger(__name__)


_HEADERS: Final = {"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}


@dataclass
class Endpoint:
    """One address of a stage (a pod, once a headless Service name is resolved) as this gateway sees it."""

    url: str
    in_flight: int = 0
    healthy: bool = False
    last_error: str | None = "not checked yet"

    @property
    def generate_url(self) -> str:
        return f"{self.url}{GENERATE_PATH}"


class RemoteStage(StageHandle):
    """A stage served by other processes, reached over the frame protocol.

    Balancing: each request goes to the healthy endpoint with the fewest requests in flight from this
    gateway (ties rotate). Endpoints marked unhealthy are still tried last, because the health poller
    may not have seen a restart yet. A refused connection fails over to the next endpoint at once (no
    request was sent); a connection lost after the response started cannot be retried (tokens already
    went to the client) and fails the request with a 502 that names the stage.
    """

    def __init__(
        self,
        stage: Stage,
        settings: RuntimeSettings,
        *,
        endpoints: tuple[str, ...] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(stage)
        urls = endpoints if endpoints is not None else stage.endpoints
        if not urls:
            raise ValueError(f"stage {stage.name!r} has no endpoints in the pipeline file")
        self.endpoints = [Endpoint(url.rstrip("/")) for url in urls]
        # What the pipeline file names; ``endpoints`` is what they currently resolve to.
        self._configured = tuple(url.rstrip("/") for url in urls)
        self._settings = settings
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        # Streamed request bodies need a full-duplex client: httpcore sends the whole body before it
        # reads the response, so a downstream stage's output could only start once its upstream had
        # finished. aiohttp writes the body from its own task while the response is read.
        self._duplex: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._rotation = itertools.count()

    async def start(self) -> None:
        # TCP_NODELAY: frames are small and latency-bound (one per token); Nagle would hold them back.
        transport = self._transport or httpx.AsyncHTTPTransport(
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)], retries=0
        )
        s = self._settings
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(
                connect=s.connect_timeout, read=s.stage_read_timeout, write=s.stage_read_timeout, pool=s.connect_timeout
            ),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        await self.check_health()
        self._poller = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._duplex is not None:
            await self._duplex.close()
            self._duplex = None

    @property
    def ready(self) -> bool:
        return any(e.healthy for e in self.endpoints)

    def describe(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "mode": "remote",
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
        try:
            resp = await self._client.get(f"{endpoint.url}/health", timeout=self._settings.connect_timeout)
        except httpx.HTTPError as err:
            self._mark(endpoint, healthy=False, error=f"{type(err).__name__}: {err}")
            return
        if resp.status_code == 200:
            self._mark(endpoint, healthy=True, error=None)
        else:
            self._mark(endpoint, healthy=False, error=f"/health answered {resp.status_code}")

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
            parsed = httpx.URL(url)
            host, port = parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80)
            if _is_ip(host):
                wanted.append(url)
                continue
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), self._settings.connect_timeout
                )
            except (OSError, TimeoutError):
                wanted.append(url)
                continue
            addresses = sorted({str(info[4][0]) for info in infos})
            wanted.extend(str(parsed.copy_with(host=addr)).rstrip("/") for addr in addresses)
        current = {e.url: e for e in self.endpoints}
        if list(current) != wanted:
            log.info("Stage %s endpoints: %s", self.name, ", ".join(wanted))
            self.endpoints = [current.get(url) or Endpoint(url) for url in wanted]

    def _candidates(self) -> list[Endpoint]:
        turn = next(self._rotation)
        n = len(self.endpoints)
        rotated = [self.endpoints[(turn + i) % n] for i in range(n)]
        # Stable sort: healthy first, then fewest in flight, ties in rotated order.
        return sorted(rotated, key=lambda e: (not e.healthy, e.in_flight))

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        if self._client is None:
            raise StageUnavailableError(f"stage {self.name!r} client is not started")
        head = encode_frame_bytes(RequestFrame(request=inp.request, tensors=inp.tensors))
        if inp.upstream is not None:
            # A downstream stage: the body is the request frame followed by the upstream stage's frames
            # as they are produced, so this stage starts before the upstream one has finished. The
            # stream can be consumed once, so there is exactly one attempt.
            endpoint = self._candidates()[0]
            endpoint.in_flight += 1
            try:
                async for frame in self._duplex_stream(endpoint, _streamed_body(head, inp.upstream)):
                    yield frame
            finally:
                endpoint.in_flight -= 1
            return
        body = head
        failures: list[str] = []
        attempts = [(e, try_) for e in self._candidates() for try_ in range(2)]
        for endpoint, try_ in attempts:
            if try_ and not failures[-1].endswith(_STALE):
                continue  # a second try on the same endpoint only after a stale pooled connection
            endpoint.in_flight += 1
            started = False
            try:
                async for frame in self._stream(endpoint, body):
                    started = True
                    yield frame
                return
            except _RetryableError as err:
                # Raised only before the stage produced anything, so nothing reached the caller.
                assert not started
                failures.append(f"{endpoint.url}: {err}")
            finally:
                endpoint.in_flight -= 1
        raise StageUnavailableError(f"stage {self.name!r} is unavailable ({'; '.join(failures)})")

    async def _duplex_stream(self, endpoint: Endpoint, body: AsyncIterator[bytes]) -> AsyncIterator[ResponseFrame]:
        if self._duplex is None:
            s = self._settings
            self._duplex = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=s.connect_timeout, sock_read=s.stage_read_timeout
                ),
                connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
            )
        try:
            async with self._duplex.post(endpoint.generate_url, data=body, headers=_HEADERS, chunked=True) as resp:
                if resp.status != 200:
                    raw = await resp.read()
                    raise _error_from_body(self.name, resp.status, resp.headers.get("content-type", ""), raw)
                if (sock := resp.connection and resp.connection.transport) is not None:
                    sock.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                async with contextlib.aclosing(self._frames(endpoint, resp.content.iter_any())) as frames:
                    async for frame in frames:
                        yield frame
        except aiohttp.ClientConnectorError as err:
            self._mark(endpoint, healthy=False, error=f"{type(err).__name__}: {err}")
            raise StageUnavailableError(f"stage {self.name!r} is unavailable ({endpoint.url}: {err})") from err
        except TimeoutError as err:
            raise self._silent(endpoint) from err
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as err:
            raise self._lost(endpoint, err) from err
        except FrameError as err:
            raise self._malformed(endpoint, err) from err

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

    async def _stream(self, endpoint: Endpoint, body: bytes) -> AsyncIterator[ResponseFrame]:
        assert self._client is not None
        responded = False
        try:
            async with self._client.stream("POST", endpoint.generate_url, content=body, headers=_HEADERS) as resp:
                responded = True
                if resp.status_code == 503:
                    await resp.aread()
                    self._mark(endpoint, healthy=False, error="stage answered 503 (not ready)")
                    raise _RetryableError("not ready (503)")
                if resp.status_code != 200:
                    raise await self._http_error(resp)
                async with contextlib.aclosing(self._frames(endpoint, resp.aiter_raw())) as frames:
                    async for frame in frames:
                        yield frame
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as err:
            self._mark(endpoint, healthy=False, error=f"{type(err).__name__}: {err}")
            raise _RetryableError(f"cannot connect ({type(err).__name__})") from err
        except httpx.ReadTimeout as err:
            raise self._silent(endpoint) from err
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
            if not responded:
                # Typically a pooled keep-alive connection the stage had closed (e.g. a restart): the
                # request never ran, so another attempt is safe. A dead stage then refuses the connect.
                raise _RetryableError(f"{type(err).__name__}: {_STALE}") from err
            raise self._lost(endpoint, err) from err
        except FrameError as err:
            raise self._malformed(endpoint, err) from err

    # What went wrong mid-response, the same whichever client (httpx or aiohttp) saw it.

    def _silent(self, endpoint: Endpoint) -> StageError:
        return StageError(
            f"stage {self.name!r} at {endpoint.url} sent nothing for {self._settings.stage_read_timeout:g} s",
            status=504,
            type="timeout",
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

    async def _http_error(self, resp: httpx.Response) -> StageError:
        raw = await resp.aread()
        return _error_from_body(self.name, resp.status_code, resp.headers.get("content-type", ""), raw)


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
    """Nothing reached the stage; another endpoint may take the request."""
