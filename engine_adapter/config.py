"""The engine's settings: one pydantic-settings model read from YAML, environment and CLI flags.

`configs/engine.yaml` documents every key. The environment prefix is `MMGATE_ENGINE_` (then `__` for nesting,
e.g. `MMGATE_ENGINE_ENCODER__MAX_RESIDENT_BYTES=512MiB`): the gateway reads `MMGATE_*` too, and both have a
`server` section, so the engine's variables carry their own prefix and one shell can configure both.
Byte sizes accept integers or strings such as `256MiB`, `1.5GiB`, `64MB`; `null` turns a limit off.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ByteSize, Field, HttpUrl, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from encoder_scheduler import SchedulingPolicy
from engine_adapter.models.presets import PRESETS
from processor_geometry import GEOMETRIES
from serving.log_format import LogFormat
from serving.settings_loader import LayeredSettings
from serving.settings_types import (
    Bytes,
    LogLevel,
    Nullable,
    OptionalCount,
    OptionalPositiveBytes,
    OptionalSeconds,
    OptionalText,
    PositiveBytes,
    Seconds,
    Section,
)

ENV_PREFIX = "MMGATE_ENGINE_"
EMBEDDING_DTYPES = ("float32", "bfloat16", "float16")


class BackendKind(StrEnum):
    REFERENCE = "reference"
    OPENAI = "openai"


class EmbedsFormat(StrEnum):
    VLLM = "vllm"
    TRTLLM = "trtllm"


class Resize(StrEnum):
    """transformers' image processor backend whose resize the pixels follow (processor_geometry/qwen.py)."""

    PIL = "pil"
    TORCHVISION = "torchvision"


class ServerSettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    auth_token: OptionalText = None
    drain_timeout_s: Seconds = 30.0
    log_level: LogLevel = "info"
    # json: every stderr line one JSON object (log shippers); text: plain lines (a terminal).
    log_format: LogFormat = LogFormat.JSON
    # One JSON line per request on stdout; access_log_probes false leaves /healthz and /metrics out.
    access_log: bool = True
    access_log_probes: bool = True
    response_claim_timeout_s: Seconds = 30.0
    max_request_body_bytes: PositiveBytes = ByteSize(512 << 20)
    # How often free heap memory goes back to the system (glibc's malloc_trim, serving/allocator.py); null: never.
    malloc_trim_interval_s: OptionalSeconds = 1.0

    @field_validator("auth_token")
    @classmethod
    def _usable_token(cls, value: str | None) -> str | None:
        if value is not None and (not value.isascii() or not value.isprintable() or " " in value):
            raise ValueError("must be printable ASCII without spaces (it travels in an Authorization header)")
        return value


class ModelSettings(Section):
    # The tower: `preset` when set (with a checkpoint, its config.json must describe that tower); else the one
    # the checkpoint's config.json describes; else tiny (engine_adapter/encoder.py).
    preset: OptionalText = None
    checkpoint: OptionalText = None
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    processor: OptionalText = None
    resize: Resize = Resize.PIL
    min_pixels: OptionalCount = None
    max_pixels: OptionalCount = None
    # The video processor's pixel bounds, of one frame (Qwen2-VL, Qwen2.5-VL) or of the clip's frames x pixels
    # (Qwen3-VL); null: the processor geometry's own (for Qwen2-VL and Qwen2.5-VL, model.min/max_pixels).
    video_min_pixels: OptionalCount = None
    video_max_pixels: OptionalCount = None

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in PRESETS:
            raise ValueError(
                f"unknown preset {value!r}; known: {', '.join(PRESETS)}, or null (the tower model.checkpoint's "
                "config.json describes; tiny without a checkpoint)"
            )
        return value

    @field_validator("processor")
    @classmethod
    def _known_processor(cls, value: str | None) -> str | None:
        if value is not None and value not in GEOMETRIES:
            raise ValueError(f"unknown processor geometry {value!r}; known: {', '.join(GEOMETRIES)} or null")
        return value

    @model_validator(mode="after")
    def _pixel_range(self) -> ModelSettings:
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(
                f"model.min_pixels={self.min_pixels:,} is larger than model.max_pixels={self.max_pixels:,}"
            )
        low, high = self.video_min_pixels, self.video_max_pixels
        if low is not None and high is not None and low > high:
            raise ValueError(f"model.video_min_pixels={low:,} is larger than model.video_max_pixels={high:,}")
        return self


class EncoderSettings(Section):
    max_num_items: int = Field(16, ge=1)
    max_num_tokens: int = Field(16384, ge=1)
    max_resident_bytes: OptionalPositiveBytes = ByteSize(256 << 20)
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.DEFAULT
    cache_max_bytes: Bytes = ByteSize(0)
    max_pending_input_bytes: OptionalPositiveBytes = ByteSize(2 << 30)


class HandoffSettings(Section):
    backend: BackendKind = BackendKind.REFERENCE
    url: Annotated[HttpUrl | None, Nullable] = None
    format: EmbedsFormat = EmbedsFormat.VLLM
    max_concurrency: int = Field(8, ge=1)
    connect_timeout_s: Seconds = 5.0
    read_timeout_s: Seconds = 600.0
    model: OptionalText = None
    api_key: OptionalText = None
    expected_hidden_size: OptionalCount = None
    expected_dtype: OptionalText = None

    @field_validator("expected_dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        if value is not None and value not in EMBEDDING_DTYPES:
            raise ValueError(f"must be one of {', '.join(EMBEDDING_DTYPES)} or null")
        return value

    @model_validator(mode="after")
    def _url_for_openai(self) -> HandoffSettings:
        if self.backend is BackendKind.OPENAI and self.url is None:
            raise ValueError("handoff.url is required when handoff.backend is openai")
        return self

    @property
    def base_url(self) -> str:
        return "" if self.url is None else str(self.url).rstrip("/")


class EngineSettings(LayeredSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True)

    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    encoder: EncoderSettings = EncoderSettings()
    handoff: HandoffSettings = HandoffSettings()
