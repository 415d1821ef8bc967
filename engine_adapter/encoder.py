"""The vision encoder: the tower on its device, the processor geometry that feeds it, and the one thread that
runs it.

The tower is `model.preset` when set (with `model.checkpoint` too, its config.json must describe that tower);
else the one `model.checkpoint`'s config.json describes; else the tiny preset.

Every forward pass runs on a single dedicated thread that owns the device, never on the event loop: the loop
keeps answering HTTP while a batch encodes, and CUDA work is issued from one thread in one order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch

from engine_adapter.config import ModelSettings
from engine_adapter.device import DeviceChoice, describe, select_device, synchronize
from engine_adapter.models import (
    PRESETS,
    CheckpointError,
    ConfigMismatchError,
    NoTowerConfigError,
    VisionTower,
    VisionTowerConfig,
    build_vision_tower,
    tower_config,
)
from engine_adapter.processor import Normalization, normalization
from processor_geometry import ProcessorGeometry, get_geometry
from serving.settings_loader import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class VisionEncoder:
    """A loaded tower plus what the engine derives from it: embedding width, dtype, geometry."""

    def __init__(self, settings: ModelSettings) -> None:
        try:
            self.choice: DeviceChoice = select_device(settings.device, settings.dtype)
        except ValueError as exc:
            raise ConfigError(f"model.device / model.dtype: {exc}") from None
        with _checkpoint_errors(settings):
            self.config: VisionTowerConfig = tower_config(settings.preset, settings.checkpoint)
        self.tower_source = _tower_source(settings)
        self.geometry = _geometry(settings, self.config)
        with _checkpoint_errors(settings):
            loaded = build_vision_tower(
                self.config,
                checkpoint=settings.checkpoint,
                seed=settings.seed,
                device=self.choice.device,
                dtype=self.choice.dtype,
            )
        self.model: VisionTower = loaded.model
        self.weights = loaded.weights
        self.from_checkpoint = loaded.from_checkpoint
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mmgate-encoder")
        self._normalization: Normalization | None = None
        logger.info(
            "encoder %s (%s, %d blocks of %d, %d heads, %d wide out%s; from %s) on %s, %s weights; "
            "processor %s (pixels %s..%s, video pixels %s..%s a %s)",
            self.config.name,
            self.config.arch,
            self.config.depth,
            self.config.hidden_size,
            self.config.num_heads,
            self.config.out_hidden_size,
            _deepstack_note(self.config),
            self.tower_source,
            describe(self.choice),
            self.weights,
            self.geometry.name,
            f"{self.geometry.min_pixels:,}",
            f"{self.geometry.max_pixels:,}",
            f"{self.geometry.video_pixels[0]:,}",
            f"{self.geometry.video_pixels[1]:,}",
            self.geometry.video_bounds,
        )

    @property
    def device(self) -> torch.device:
        return self.choice.device

    @property
    def dtype(self) -> torch.dtype:
        return self.choice.dtype

    @property
    def width(self) -> int:
        """Embedding row width: the LLM's hidden size, times 1 + the DeepStack layers for Qwen3-VL (each row
        holds the visual features and every DeepStack layer's, side by side): what a buffer row holds."""
        return self.config.output_width

    @property
    def merge_unit(self) -> int:
        """Encoder tokens folded into one embedding row."""
        return self.config.merge_unit

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode packed items; call it on the encoder thread only (see `run`). Returns when the device is done.

        `pixel_values`: patchified rows, uint8 (normalized here, on the device) or already normalized floats.
        """
        with torch.inference_mode():
            inputs = pixel_values.to(self.device, non_blocking=True)
            if inputs.dtype == torch.uint8:
                inputs = self.normalize_rows(inputs)
            output: torch.Tensor = self.model(inputs.to(self.dtype), grid_thw)
        synchronize(self.device)
        return output

    def normalize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 patch rows -> float32 rescaled and normalized with the geometry's mean and std.

        The same float32 operations in the same order as `engine_adapter.processor.normalize_frames`, applied
        after patchifying instead of before (each row column belongs to one channel), so the values are bitwise
        those of `process_image`.
        """
        if self._normalization is None or self._normalization.mean.device != rows.device:
            per_channel = self.geometry.row_width // self.geometry.channels
            self._normalization = normalization(self.geometry, rows.device, repeat=per_channel)
        return self._normalization.apply(rows.to(torch.float32))

    async def run(self, work: Callable[[], T]) -> T:
        """Run `work` on the encoder thread and wait for it without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def _tower_source(settings: ModelSettings) -> str:
    """What chose the tower (`models.tower_config`'s order), for the start-up log."""
    if settings.preset is not None:
        return "model.preset"
    if settings.checkpoint is None:
        return "the default preset"
    return str(Path(settings.checkpoint) / "config.json")


@contextmanager
def _checkpoint_errors(settings: ModelSettings) -> Iterator[None]:
    """A tower or checkpoint that cannot be built as the ConfigError naming the keys to change."""
    try:
        yield
    except ConfigMismatchError as exc:
        raise ConfigError(
            f"model.preset = {settings.preset!r} does not match model.checkpoint = {settings.checkpoint!r}: "
            f"{exc}; set model.preset to null to build the tower its config.json describes"
        ) from None
    except NoTowerConfigError as exc:
        raise ConfigError(
            f"model.checkpoint = {settings.checkpoint!r}: {exc}; with model.preset null the tower is the one the "
            f"checkpoint's config.json describes, so name its tower with model.preset ({', '.join(PRESETS)})"
        ) from None
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"model.checkpoint = {settings.checkpoint!r}: {exc}") from None


def _geometry(settings: ModelSettings, config: VisionTowerConfig) -> ProcessorGeometry:
    geometry = get_geometry(settings.processor or config.geometry_name)
    ours = (geometry.patch_size, geometry.temporal_patch_size, geometry.merge_size, geometry.channels)
    tower = (config.patch_size, config.temporal_patch_size, config.merge_size, config.in_channels)
    if ours != tower:
        raise ConfigError(
            f"model.processor = {geometry.name!r}: its patch geometry (patch, temporal, merge, channels) {ours} "
            f"does not feed tower {config.name!r}, which needs {tower}"
        )
    try:
        return dataclasses.replace(
            geometry.with_pixels(settings.min_pixels, settings.max_pixels).with_video_pixels(
                settings.video_min_pixels, settings.video_max_pixels
            ),
            resize=settings.resize.value,
        )
    except ValueError as exc:
        raise ConfigError(
            f"model.min_pixels / model.max_pixels / model.video_min_pixels / model.video_max_pixels: {exc}"
        ) from None


def _deepstack_note(config: VisionTowerConfig) -> str:
    indexes = config.deepstack_visual_indexes
    if not indexes:
        return ""
    blocks = ", ".join(map(str, indexes))
    return f" + DeepStack blocks {blocks}: rows of {config.output_width}"
