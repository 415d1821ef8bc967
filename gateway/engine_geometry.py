"""Engine mode: the image and video geometry of the engine's model, read from the engine itself.

The gateway resizes each image for the engine's model before sending it. The size must be exactly the one the
engine's processor would choose, or the engine refuses the item; so the gateway never assumes it from its own
`media.processor` preset (an engine with `model.max_pixels` set differs from the preset). It reads the geometry
from the engine's `GET /internal/v1/status` at start-up and again every `refresh_s`, which also picks up an
engine restarted with another model. Until the engine has answered once, engine-mode requests with media get 503
(nothing is decoded for them); a request never waits for the engine's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import ClientError

from engine_adapter.client import EngineClient, EngineRefusal
from gateway.errors import EngineNotReady
from gateway.media.resize import ModelResize
from processor_geometry import RESIZES, VIDEO_BOUNDS, ProcessorGeometry, get_geometry

logger = logging.getLogger("mmgate.gateway")

# Fields of the status's "processor" object that fix the resize, and the preset fields they override.
_SIZES = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "channels")
# Those of a clip's resize; an engine that reports none has its preset's.
_VIDEO_SIZES = ("video_min_pixels", "video_max_pixels")


def geometry_from_status(status: Mapping[str, Any]) -> ProcessorGeometry:
    """The geometry an engine's status reports: its preset (normalization constants) with the engine's own
    patch, merge, image and video pixel bounds. Raises ValueError naming what is missing or wrong."""
    processor = status.get("processor")
    if not isinstance(processor, Mapping):
        raise ValueError("the engine's status has no processor object")
    name = processor.get("geometry")
    if not isinstance(name, str):
        raise ValueError("the engine's status names no processor geometry")
    sizes: dict[str, int] = {}
    for field in _SIZES:
        value = processor.get(field)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"the engine's status has no integer processor.{field}")
        sizes[field] = value
    resize = processor.get("resize", "pil")  # an engine that does not say resizes as Pillow does
    if resize not in RESIZES:
        raise ValueError(f"the engine's status names an unknown processor.resize {resize!r}")
    preset = get_geometry(name)
    video: dict[str, Any] = {}
    for field in _VIDEO_SIZES:
        value = processor.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"the engine's status has a non-integer processor.{field}")
        video[field] = value
    bounds = processor.get("video_bounds", preset.video_bounds)
    if bounds not in VIDEO_BOUNDS:
        raise ValueError(f"the engine's status names an unknown processor.video_bounds {bounds!r}")
    return dataclasses.replace(
        preset,
        patch_size=sizes["patch_size"],
        merge_size=sizes["merge_size"],
        temporal_patch_size=sizes["temporal_patch_size"],
        min_pixels=sizes["min_pixels"],
        max_pixels=sizes["max_pixels"],
        channels=sizes["channels"],
        resize=resize,
        video_bounds=bounds,
        video_min_pixels=preset.video_min_pixels if video["video_min_pixels"] is None else video["video_min_pixels"],
        video_max_pixels=preset.video_max_pixels if video["video_max_pixels"] is None else video["video_max_pixels"],
    )


class EngineGeometry:
    """The engine model's geometry as last read, and the `ModelResize` that resizes items for it."""

    def __init__(self, client: EngineClient, *, refresh_s: float = 10.0) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self.resize: ModelResize | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_problem: str | None = None

    @property
    def geometry(self) -> ProcessorGeometry | None:
        return self.resize.geometry if self.resize is not None else None

    def require(self) -> ModelResize:
        """The current resize; 503 while the engine has not reported its geometry."""
        if self.resize is None:
            raise EngineNotReady(
                f"the engine at {self.client.base_url} has not reported its model's image geometry yet "
                f"({self._last_problem or 'not asked yet'}); requests with images wait for it"
            )
        return self.resize

    async def start(self) -> None:
        """Read the geometry once (an engine that is not up yet is retried in the background), then keep it
        fresh."""
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._keep_fresh())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def refresh(self) -> None:
        try:
            geometry = geometry_from_status(await self.client.status())
        except (EngineRefusal, ValueError, TimeoutError, ClientError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
            if problem != self._last_problem:
                logger.warning("engine geometry from %s/internal/v1/status: %s", self.client.base_url, problem)
            self._last_problem = problem
            return
        self._last_problem = None
        if geometry != self.geometry:
            logger.info(
                "engine model geometry %s: factor %d, %s..%s pixels, video %s..%s pixels a %s, %s resize (from %s)",
                geometry.name,
                geometry.factor,
                f"{geometry.min_pixels:,}",
                f"{geometry.max_pixels:,}",
                f"{geometry.video_pixels[0]:,}",
                f"{geometry.video_pixels[1]:,}",
                geometry.video_bounds,
                geometry.resize,
                self.client.base_url,
            )
            self.resize = ModelResize(geometry)

    async def _keep_fresh(self) -> None:
        while True:
            # Fast retries until the engine first answers, then a slow refresh.
            await asyncio.sleep(self.refresh_s if self.resize is not None else min(1.0, self.refresh_s))
            await self.refresh()
