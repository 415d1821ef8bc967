"""The gateway's settings: one pydantic-settings model read from YAML, `MMGATE_*` environment and CLI flags.

`configs/gateway.yaml` documents every key. Byte sizes accept integers or strings such as `256MiB`, `1.5GiB`,
`64MB`; `null` turns a limit off.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    ByteSize,
    Field,
    HttpUrl,
    IPvAnyNetwork,
    field_validator,
    model_validator,
)
from pydantic_settings import SettingsConfigDict

from gateway import processors
from gateway.media_defaults import (
    AUDIO_CONTAINERS,
    DEFAULT_AUDIO_CODECS,
    DEFAULT_AUDIO_FORMATS,
    DEFAULT_SAMPLE_RATE,
    DEFAULT_VIDEO_CODECS,
    DEFAULT_VIDEO_FORMATS,
    MEDIA_ROUTES,
    QWEN_MAX_FRAMES,
    VIDEO_CONTAINERS,
    VLLM_NUM_FRAMES,
)
from processor_geometry import GEOMETRIES
from serving.forwarded import parse_trusted
from serving.log_format import LogFormat
from serving.settings_loader import LayeredSettings
from serving.settings_types import (
    Bytes,
    LogLevel,
    Nullable,
    OptionalBytes,
    OptionalCount,
    OptionalPositiveBytes,
    OptionalSeconds,
    Seconds,
    Section,
)

logger = logging.getLogger(__name__)


# Every route whose body an upstream reads media from (gateway/media_defaults.py, docs/admission.md).
DEFAULT_ADMISSION_ROUTES = tuple(MEDIA_ROUTES)


class BudgetMode(StrEnum):
    SLOTS = "slots"
    BYTES = "bytes"


class BudgetBackend(StrEnum):
    LOCAL = "local"
    REDIS = "redis"


class OnUnavailable(StrEnum):
    REJECT = "reject"
    LOCAL = "local"


class ReleaseOn(StrEnum):
    FIRST_BYTE = "first_byte"
    COMPLETE = "complete"


class DecodeMode(StrEnum):
    CHECK = "check"
    FULL = "full"
    HEADER = "header"


class FetchForward(StrEnum):
    INLINE = "inline"
    URL = "url"


class OpenAIEnvelope(StrEnum):
    TRTLLM = "trtllm"
    OPENAI = "openai"


class ServerSettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    metrics_path: str = "/metrics"
    # A second listener (same host) serving only `metrics_path` and `/healthz`; the main port then proxies the
    # metrics path like any other. null: the main port serves the metrics.
    metrics_port: Annotated[Annotated[int, Field(ge=1, le=65535)] | None, Nullable] = None
    drain_timeout_s: Seconds = 30.0
    access_log: bool = True
    # false: requests to /healthz, /readyz and the metrics path are not logged (they are still counted).
    access_log_probes: bool = True
    log_level: LogLevel = "info"
    # json: every stderr line one JSON object (log shippers); text: plain lines (a terminal).
    log_format: LogFormat = LogFormat.JSON
    max_connections: OptionalCount = 1024
    max_header_bytes: OptionalPositiveBytes = ByteSize(64 << 10)
    max_headers: OptionalCount = 128
    header_timeout_s: OptionalSeconds = 10.0
    body_idle_timeout_s: OptionalSeconds = 30.0
    # After body_rate_grace_s a body must average this many bytes a second (time the gateway holds back reading it
    # does not count): 408 past it. null: no minimum.
    body_min_rate_bytes_s: OptionalCount = 500
    body_rate_grace_s: Seconds = 10.0
    # Processes serving the one port (`--workers`); they share the media budget (see GatewaySettings).
    workers: int = Field(1, ge=1, le=256)
    # How often free heap memory goes back to the system (glibc's malloc_trim, serving/allocator.py); null: never.
    malloc_trim_interval_s: OptionalSeconds = 1.0
    # Refuse to start when limits.max_multimodal_cpu_bytes + limits.max_buffered_body_bytes + each process's
    # baseline pass the memory limit of the container (its cgroup): gateway/memory_fit.py, docs/sizing.md.
    check_memory_limit: bool = True
    # Peers whose X-Forwarded-For / X-Forwarded-Proto / Forwarded headers are believed (serving/forwarded.py).
    forwarded_allow_ips: tuple[str, ...] = ("127.0.0.1",)

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _addresses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        parse_trusted(value)
        return value

    @field_validator("metrics_path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        return value

    @model_validator(mode="after")
    def _two_ports(self) -> ServerSettings:
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(f"server.metrics_port={self.metrics_port} is server.port: it needs a port of its own")
        return self


class UpstreamSettings(Section):
    url: HttpUrl = HttpUrl("http://127.0.0.1:8001")
    connect_timeout_s: Seconds = 5.0
    # Between two chunks of the response (and before its headers), and while the upstream stops taking a read
    # request body over 1 MiB; there is no total timeout.
    read_timeout_s: Seconds = 600.0
    pool_timeout_s: Seconds = 30.0
    max_connections: int = Field(1024, ge=1)
    ready_path: str = "/health"
    ready_cache_s: float = Field(1.5, ge=0)
    # Forwarded besides the model servers' public API and limits.admission_routes (gateway/upstream_routes.py):
    # each path with every path under it, e.g. /metrics for the upstream's own metrics; ["/"] forwards every path.
    allowed_paths: tuple[str, ...] = ()
    # Path prefixes refused (403) even where forwarded, e.g. a public route kept from clients.
    blocked_paths: tuple[str, ...] = ()

    @field_validator("allowed_paths", "blocked_paths")
    @classmethod
    def _absolute_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        relative = [path for path in value if not path.startswith("/")]
        if relative:
            raise ValueError(f"{relative}: every path must start with '/'")
        return value


class ItemLimits(Section):
    """Media items of one modality in one request (like vLLM's `--limit-mm-per-prompt`); null: only the total
    (`limits.max_media_items_per_request`) bounds them."""

    image: OptionalCount = None
    video: OptionalCount = None
    audio: OptionalCount = None


class TenantFrom(StrEnum):
    API_KEY = "api_key"
    HEADER = "header"
    CLIENT = "client"


class Band(StrEnum):
    """A request's priority band: a waiting interactive request is served before any batch one."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class TenantSettings(Section):
    """One tenant's share of the media budget and its own bounds."""

    weight: float = Field(1.0, gt=0)
    band: Band = Band.INTERACTIVE
    max_bytes_in_use: OptionalBytes = None
    max_waiting: Annotated[Annotated[int, Field(ge=0)] | None, Nullable] = None


class FairnessSettings(Section):
    """Fair queueing of the media budget between tenants: within each process with `limits.budget_backend: local`,
    across every gateway sharing the Redis key prefix with `redis`."""

    enabled: bool = True
    tenant_from: TenantFrom = TenantFrom.API_KEY
    tenant_header: str = Field("x-tenant-id", min_length=1)
    # The key of the BLAKE2b digest that stands for an API key; empty: unkeyed, the same id in every process.
    key_salt: str = Field("", max_length=64)
    window_s: float = Field(60.0, gt=0)
    max_tenants: int = Field(10_000, ge=1)
    priority_header: str = Field("x-mmgate-priority", min_length=1)
    # Set by a trusted proxy (server.forwarded_allow_ips), the first of these headers a request carries is its
    # tenant, whatever tenant_from says: the fairness id of llm-d's and the Gateway API Inference Extension's flow
    # control. From any other peer they are dropped, never believed nor forwarded. []: never believed.
    proxy_tenant_headers: tuple[str, ...] = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
    batch_admission_timeout_s: OptionalSeconds = 300.0
    default: TenantSettings = TenantSettings()
    tenants: dict[str, TenantSettings] = Field(default={})

    @field_validator("tenant_header", "priority_header")
    @classmethod
    def _lowercase_header(cls, value: str) -> str:
        return value.lower()

    @field_validator("proxy_tenant_headers")
    @classmethod
    def _lowercase_headers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not name.strip() for name in value):
            raise ValueError("a header name cannot be empty")
        return tuple(name.strip().lower() for name in value)

    @field_validator("tenants")
    @classmethod
    def _not_other(cls, value: dict[str, TenantSettings]) -> dict[str, TenantSettings]:
        if "other" in value:
            raise ValueError("'other' names every tenant not configured here: choose another name")
        return value


class LimitsSettings(Section):
    max_request_body_bytes: OptionalBytes = ByteSize(64 << 20)
    max_other_body_bytes: OptionalBytes = ByteSize(64 << 20)
    max_multimodal_cpu_bytes_per_request: OptionalBytes = ByteSize(512 << 20)
    max_multimodal_cpu_bytes: OptionalBytes = ByteSize(2 << 30)
    max_image_pixels: OptionalCount = 178_956_970
    max_image_metadata_bytes: OptionalBytes = ByteSize(16 << 20)
    # DCI 4K (4096 x 2160), the largest frame common cameras record.
    max_video_pixels: OptionalCount = 4096 * 2160
    max_video_seconds: OptionalSeconds = 3600.0
    max_audio_seconds: OptionalSeconds = 3600.0
    max_media_items_per_request: OptionalCount = 256
    max_items: ItemLimits = ItemLimits()
    admission_timeout_s: OptionalSeconds = 30.0
    max_queued_requests: Annotated[Annotated[int, Field(ge=0)] | None, Nullable] = 1024
    # Request bodies the gateway holds at once (read, parsed, waiting, forwarded) and what parsing them allocates;
    # each worker holds its `server.workers` share, and a body it cannot hold is refused before it is read.
    # Unset: limits.max_multimodal_cpu_bytes.
    max_buffered_body_bytes: OptionalBytes = ByteSize(2 << 30)
    budget_mode: BudgetMode = BudgetMode.BYTES
    budget_backend: BudgetBackend = BudgetBackend.LOCAL
    release_on: ReleaseOn = ReleaseOn.FIRST_BYTE
    charge_raw_body: bool = True
    admission_routes: tuple[str, ...] = DEFAULT_ADMISSION_ROUTES
    fairness: FairnessSettings = FairnessSettings()

    @model_validator(mode="before")
    @classmethod
    def _defaults_follow_the_total(cls, data: Any) -> Any:
        # With the total set, the per-request cap and the bound on buffered bodies default to it.
        if isinstance(data, dict) and "max_multimodal_cpu_bytes" in data:
            for key in ("max_multimodal_cpu_bytes_per_request", "max_buffered_body_bytes"):
                if key not in data:
                    data = {**data, key: data["max_multimodal_cpu_bytes"]}
        return data

    @model_validator(mode="after")
    def _per_request_within_total(self) -> LimitsSettings:
        total, per_request = self.max_multimodal_cpu_bytes, self.max_multimodal_cpu_bytes_per_request
        if total is not None and per_request is not None and per_request > total:
            raise ValueError(
                f"limits.max_multimodal_cpu_bytes_per_request={per_request:,} is larger than "
                f"limits.max_multimodal_cpu_bytes={total:,}: no request could ever be admitted"
            )
        if total is not None and per_request is None:
            raise ValueError(
                "limits.max_multimodal_cpu_bytes is set but limits.max_multimodal_cpu_bytes_per_request "
                "is null: "
                "slots need a per-request size"
            )
        return self

    @property
    def budget_slots(self) -> int | None:
        """Concurrent media requests the process budget admits in `slots` mode (None: no process budget)."""
        total, per_request = self.max_multimodal_cpu_bytes, self.max_multimodal_cpu_bytes_per_request
        if total is None or per_request is None:
            return None
        return max(1, total // max(1, per_request))


class FetchSettings(Section):
    enabled: bool = True
    max_bytes: Bytes = ByteSize(32 << 20)
    connect_timeout_s: Seconds = 5.0
    read_timeout_s: Seconds = 10.0
    total_timeout_s: Seconds = 30.0
    max_redirects: int = Field(3, ge=0)
    allow_private_networks: bool = False
    # CIDRs reachable even though they are not global (e.g. an internal image store), checked per address.
    allowed_networks: tuple[IPvAnyNetwork, ...] = ()
    allowed_domains: tuple[str, ...] = ()
    user_agent: str = "mmgate-media-fetch/0.1"
    # inline: the upstream gets each downloaded item as a data URL of exactly the bytes the gateway checked and
    # counted; url: the upstream gets the URL and downloads it again (it may get other bytes, from its own network).
    forward: FetchForward = FetchForward.INLINE


class VideoSettings(Section):
    """Which frames of a video are decoded and counted: the ones the model server samples."""

    # vLLM's default: 32 frames spread evenly over the video. null with `fps` set: the Qwen rule (duration x fps).
    num_frames: OptionalCount = VLLM_NUM_FRAMES
    fps: Annotated[Annotated[float, Field(gt=0)] | None, Nullable] = None
    # Qwen's video processors sample at most 768 frames.
    max_frames: OptionalCount = QWEN_MAX_FRAMES
    decode_timeout_s: OptionalSeconds = 30.0

    @model_validator(mode="after")
    def _a_sampling_rule(self) -> VideoSettings:
        if self.num_frames is None and self.fps is None:
            raise ValueError("media.video needs num_frames or fps: one of them chooses the frames that are decoded")
        return self


class AudioSettings(Section):
    # The rate the model's feature extractor takes (Whisper, Qwen2-Audio: 16 kHz); audio is resampled to it.
    sample_rate: int = Field(DEFAULT_SAMPLE_RATE, ge=1000, le=384_000)
    decode_timeout_s: OptionalSeconds = 10.0


def _known_names(value: tuple[str, ...], known: dict[str, str]) -> tuple[str, ...]:
    names = tuple(name.lower() for name in value)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown formats {unknown}; known: {', '.join(sorted(known))}")
    return names


class MediaSettings(Section):
    load_workers: int = Field(8, ge=1)
    formats: tuple[str, ...] = ("jpeg", "png", "webp", "gif", "bmp")
    decode: DecodeMode = DecodeMode.CHECK
    decode_timeout_s: OptionalSeconds = 10.0
    max_jpeg_scans: OptionalCount = 100
    # The model server's processor whose peak is charged: auto (follow the upstream's GET /v1/models), a family
    # (qwen2_vl, qwen2_5_vl, qwen3_vl, glm4v, gemma3, llama4, internvl3, pixtral, mistral3, phi4_multimodal,
    # llava_onevision), a model's config directory (its preprocessor_config.json names the family and its
    # parameters), or null (decoded pixels only).
    processor: Annotated[str | None, Nullable] = "auto"
    video_formats: tuple[str, ...] = DEFAULT_VIDEO_FORMATS
    video_codecs: tuple[str, ...] = DEFAULT_VIDEO_CODECS
    audio_formats: tuple[str, ...] = DEFAULT_AUDIO_FORMATS
    audio_codecs: tuple[str, ...] = DEFAULT_AUDIO_CODECS
    video: VideoSettings = VideoSettings()
    audio: AudioSettings = AudioSettings()
    fetch: FetchSettings = FetchSettings()

    @field_validator("formats")
    @classmethod
    def _lowercase_formats(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(fmt.lower() for fmt in value)

    @field_validator("video_formats")
    @classmethod
    def _known_video_formats(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _known_names(value, VIDEO_CONTAINERS)

    @field_validator("audio_formats")
    @classmethod
    def _known_audio_formats(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _known_names(value, AUDIO_CONTAINERS)

    @field_validator("processor")
    @classmethod
    def _known_processor(cls, value: str | None) -> str | None:
        try:
            return processors.valid_setting(value)
        except (ValueError, OSError) as exc:
            raise ValueError(
                f"{exc}; expected auto, one of {', '.join(processors.FAMILIES)}, a model's config directory, or null"
            ) from None


class ErrorSettings(Section):
    openai_envelope: OpenAIEnvelope = OpenAIEnvelope.TRTLLM
    # false: a failure behind the gateway (upstream, engine, Redis) tells the client what failed and which setting,
    # never an internal URL or address, and /readyz on the main port names none (the access log's `error` and the
    # metrics port have them); true: the client gets the full message.
    expose_internal: bool = False


class EngineModeSettings(Section):
    """Engine mode: with `url` set, chat requests with media go through the engine process."""

    url: Annotated[HttpUrl | None, Nullable] = None
    auth_token: str | None = None
    connect_timeout_s: Seconds = 5.0
    read_timeout_s: Seconds = 600.0


class RedisSettings(Section):
    """The shared media budget's Redis (`limits.budget_backend: redis`)."""

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = Field("mmgate:budget", min_length=1)
    # What the shared budget protects: the model server (or host) that every gateway sharing it fronts. Gateways
    # share one budget when key_prefix and scope are the same (its keys are under <key_prefix>:<scope>). null:
    # upstream.url's host:port (engine mode: engine.url's); for one on loopback, this host's name and the port,
    # since a server on loopback is this host's (or pod's) own, which no gateway elsewhere fronts.
    scope: Annotated[str | None, Nullable] = None
    socket_timeout_s: float = Field(1.0, gt=0)
    lease_ttl_s: float = Field(10.0, gt=0)
    on_unavailable: OnUnavailable = OnUnavailable.REJECT
    # Gateway replicas sharing the budget; with on_unavailable=local each process falls back to
    # limits.max_multimodal_cpu_bytes // (expected_replicas x server.workers).
    expected_replicas: int = Field(1, ge=1)

    @field_validator("scope")
    @classmethod
    def _one_word(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(char.isspace() for char in value)):
            raise ValueError("must be a non-empty name without spaces, e.g. the model server's host:port")
        return value

    @field_validator("url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return value


class GatewaySettings(LayeredSettings):
    model_config = SettingsConfigDict(env_prefix="MMGATE_", env_nested_delimiter="__", extra="forbid", frozen=True)

    server: ServerSettings = ServerSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    limits: LimitsSettings = LimitsSettings()
    media: MediaSettings = MediaSettings()
    errors: ErrorSettings = ErrorSettings()
    engine: EngineModeSettings = EngineModeSettings()
    redis: RedisSettings = RedisSettings()

    @model_validator(mode="after")
    def _engine_mode_needs_a_processor(self) -> GatewaySettings:
        if self.engine.url is not None and self.media.processor is None:
            raise ValueError(
                "engine.url is set but media.processor is null: engine mode resizes images for the engine's model, "
                f"so media.processor must name its family ({', '.join(GEOMETRIES)}) or auto"
            )
        return self

    @model_validator(mode="after")
    def _workers_share_the_local_budget(self) -> GatewaySettings:
        # With the local backend and several workers each process holds `total // workers`: a request whose
        # per-request cap is larger than that share could never be admitted.
        limits, workers = self.limits, self.server.workers
        total, per_request = limits.max_multimodal_cpu_bytes, limits.max_multimodal_cpu_bytes_per_request
        if limits.budget_backend is BudgetBackend.LOCAL and workers > 1 and total is not None:
            share = total // workers
            if per_request is not None and per_request > share:
                raise ValueError(
                    f"server.workers={workers} with limits.budget_backend=local gives each worker "
                    f"limits.max_multimodal_cpu_bytes // server.workers = {share:,} bytes, less than "
                    f"limits.max_multimodal_cpu_bytes_per_request={per_request:,}: no worker could admit a request "
                    "of that size; lower the per-request cap, use fewer workers, or share one budget with "
                    "limits.budget_backend=redis"
                )
        return self

    @property
    def body_buffer_share(self) -> int | None:
        """What one worker process may hold of `limits.max_buffered_body_bytes`: bodies are each process's memory,
        whatever budget backend the media budget uses."""
        total = self.limits.max_buffered_body_bytes
        return None if total is None else max(1, total // self.server.workers)

    @property
    def budget_processes(self) -> int:
        """Processes the media budget is shared by from this configuration's point of view (the fallback share)."""
        return self.redis.expected_replicas * self.server.workers
