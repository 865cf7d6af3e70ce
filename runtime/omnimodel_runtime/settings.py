"""Runtime settings: one pydantic-settings object per process, from ``OMNIMODEL_*`` env and CLI flags.

The operator's Deployments set ``OMNIMODEL_MODEL_CACHE``, ``OMNIMODEL_DEVICE`` and (gateway)
``OMNIMODEL_API_KEY`` and pass ``--pipeline/--stage/--host/--port`` as flags; the CLI hands flags in
as init arguments, which take precedence over the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

Device = Literal["auto", "cpu", "cuda", "xpu", "npu"]


def _default_model_cache() -> Path:
    return Path.home() / ".cache" / "omnimodel" / "models"


class StageTimeouts(BaseModel):
    """Timeouts of one stage as the gateway applies them; unset ones fall back to the process-wide
    ``connect_timeout``, ``stage_read_timeout`` and ``health_timeout``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect: Annotated[float, Field(gt=0)] | None = None
    read: Annotated[float, Field(gt=0)] | None = None
    health: Annotated[float, Field(gt=0)] | None = None


@dataclass(frozen=True)
class ResolvedTimeouts:
    connect: float
    read: float
    health: float


class RuntimeSettings(BaseSettings):
    """Everything a stage, gateway or ``serve`` process reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="OMNIMODEL_", extra="ignore", frozen=True)

    pipeline: Path | None = None
    stage: str | None = None
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    # Clients must send ``Authorization: Bearer <key>`` when set (gateway only; stages sit behind a
    # NetworkPolicy that admits only the gateway and upstream stages).
    api_key: SecretStr | None = None
    model_cache: Path = Field(default_factory=_default_model_cache)
    # Root under which ``pvc://claim/path`` sources are mounted (``<root>/<claim>/<path>``).
    pvc_root: Path = Path("/mnt/pvc")
    device: Device = "auto"
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # "json": every log line (the access log included) is one JSON object, for log collectors.
    log_format: Literal["text", "json"] = "text"

    # Gateway requests are JSON; a few MiB is plenty and keeps a flood of huge bodies cheap to refuse.
    max_body_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    # Stage requests may carry tensors (a 15 MB hidden-state hand-off and far more for video).
    stage_max_body_bytes: Annotated[int, Field(gt=0)] = 1024 * 1024 * 1024
    # Chat images and videos given as http(s) URLs: fetched by the gateway only when true (off: a gateway
    # fetching any URL a client names reaches whatever its network reaches); data: URLs are always accepted.
    media_fetch: bool = False
    # The largest image or video the gateway fetches for one content part.
    media_max_bytes: Annotated[int, Field(gt=0)] = 20 * 1024 * 1024
    # Upper bound on one request end to end; becomes the deadline stages enforce.
    request_timeout: Annotated[float, Field(gt=0)] = 600.0
    # Connecting to a stage is a LAN hop; a dead pod must fail fast, not after the request timeout.
    connect_timeout: Annotated[float, Field(gt=0)] = 3.0
    # Longest silence tolerated between two frames of a stage response before it counts as hung (a
    # non-streamed request sends its one frame at the end, so this bounds a whole generation).
    stage_read_timeout: Annotated[float, Field(gt=0)] = 120.0
    # How often the gateway re-checks every stage endpoint's /health.
    health_interval: Annotated[float, Field(gt=0)] = 1.0
    # A stage's /health answers from its event loop while the engine works on its own thread, so it is
    # quick even under load; one slower than this is a hung process (SIGSTOP, a wedged node): the
    # endpoint leaves the pool at once and the requests waiting on it are failed over or failed.
    health_timeout: Annotated[float, Field(gt=0)] = 1.0
    # Per-stage overrides of the three stage timeouts, by stage name, e.g.
    # OMNIMODEL_STAGE_TIMEOUTS='{"denoise": {"read": 900}, "talker": {"health": 3}}'.
    stage_timeouts: dict[str, StageTimeouts] = Field(default_factory=dict)
    # Stages that may have no replica at all (scaled to zero by the operator's autoscaler), by name, with
    # how long a request for one is held while it wakes (seconds), e.g. OMNIMODEL_STAGE_WAKE='{"talker": 300}'.
    # Such a stage does not make /health 503; its held requests are what the autoscaler sees as
    # omnimodel_gateway_stage_waiting. Any other stage without a healthy endpoint fails requests at once.
    stage_wake: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    # Re-resolve stage hostnames (headless Services) to per-pod endpoints on every health poll.
    resolve_endpoints: bool = True
    # How long SIGTERM waits for in-flight requests before the process exits anyway (pods get 60 s).
    drain_timeout: Annotated[float, Field(ge=0)] = 30.0

    # What chat completions answer with when a request leaves ``modalities`` out (only the modalities the
    # pipeline outputs count). OpenAI's default is text; vLLM-Omni answers with every output modality, so
    # its Qwen-Omni clients, which leave it out, get audio only with '["text","audio"]'.
    chat_default_modalities: Annotated[list[Literal["text", "audio"]], Field(min_length=1)] = ["text"]

    # Batching engines may hold the first request of an idle engine this long (seconds) to start a
    # burst as one batch. 0 (default) starts at once: with continuous batching, requests arriving
    # a moment later join at the next step anyway, so waiting only adds latency.
    batch_wait: Annotated[float, Field(ge=0)] = 0.0
    max_batch_size: Annotated[int, Field(ge=1)] = 32

    # How long (seconds) a thread may hold the GIL while another waits for it (``sys.setswitchinterval``;
    # Python's default is 0.005). Stage workers hand frames to the event loop thread, which needs the GIL
    # for every wake-up: with Python's 5 ms and three busy omni workers in one process, Qwen2.5-Omni streams
    # on an H200 waited for it (only this changed, bench/omni_timeline.py: first audio of four streams at
    # once 2.2-2.4 s vs 0.89-1.05 s at 0.5 ms; latency of one 3.85-4.17 s vs 3.33-3.45 s).
    gil_switch_interval: Annotated[float, Field(gt=0)] = 0.0005

    def timeouts_for(self, stage: str) -> ResolvedTimeouts:
        """The connect, read and health timeouts the gateway uses for ``stage``."""
        own = self.stage_timeouts.get(stage, StageTimeouts())
        return ResolvedTimeouts(
            connect=own.connect or self.connect_timeout,
            read=own.read or self.stage_read_timeout,
            health=own.health or self.health_timeout,
        )
