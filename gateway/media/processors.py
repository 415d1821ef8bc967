"""Which model server processor a request's media are charged for (`media.processor`).

A model server turns each image into float32 tensors several times the decoded pixels (a 1080p image: about 6 MB
decoded, about 50 MB processed for Qwen2.5-VL); the gateway charges those too, so the budget protects the
upstream's memory. `auto` (the default) follows the model the upstream serves, read from its `GET /v1/models` (the
id or the root of each model, by family name: Qwen3-VL, Qwen2.5-VL, Qwen2-VL) at start-up and again at each
readiness probe until it is known; until then every charge is the largest the known processors would make. A name
fixes the processor; `null` charges decoded pixels only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import aiohttp
import orjson

from engine_adapter.client import GEOMETRIES, ProcessorGeometry, get_geometry

AUTO = "auto"

logger = logging.getLogger("mmgate.gateway")

# Most specific first: "Qwen2.5-VL" must not be read as Qwen2-VL.
_FAMILIES = (
    ("qwen3_vl", re.compile(r"qwen[-_]?3[-_.]?vl", re.IGNORECASE)),
    ("qwen2_5_vl", re.compile(r"qwen[-_]?2[._]5[-_.]?vl", re.IGNORECASE)),
    ("qwen2_vl", re.compile(r"qwen[-_]?2[-_.]?vl", re.IGNORECASE)),
)


def family(names: Iterable[str]) -> str | None:
    """The processor of the first known model family among `names` (a served model's id, its root...)."""
    for name in names:
        for processor, pattern in _FAMILIES:
            if pattern.search(name):
                return processor
    return None


def served_names(models: Any) -> list[str]:
    """The ids and roots of the models in an OpenAI `GET /v1/models` answer."""
    data = models.get("data") if isinstance(models, dict) else None
    names: list[str] = []
    for model in data if isinstance(data, list) else []:
        if isinstance(model, dict):
            names += [value for key in ("id", "root") if isinstance(value := model.get(key), str)]
    return names


class Processors:
    """The processors whose tensors are charged: the one `media.processor` names, the upstream's (`auto`, once it
    is known), or while `auto` does not know it every known one (the largest charge of them)."""

    def __init__(self, setting: str | None) -> None:
        self.setting = setting
        self.chosen: ProcessorGeometry | None = None if setting in (None, AUTO) else get_geometry(setting)
        self.model: str | None = None  # the served model `auto` chose from

    @property
    def deciding(self) -> bool:
        """`auto` without a processor chosen yet."""
        return self.setting == AUTO and self.chosen is None

    @property
    def candidates(self) -> tuple[ProcessorGeometry, ...]:
        if self.setting is None:
            return ()
        return (self.chosen,) if self.chosen is not None else tuple(GEOMETRIES.values())

    @property
    def label(self) -> str:
        """What a message names: `media.processor=qwen2_vl`, `media.processor=auto: qwen2_5_vl`..."""
        if self.setting != AUTO:
            return f"media.processor={self.setting}"
        if self.chosen is not None:
            return f"media.processor=auto: {self.chosen.name}"
        return f"media.processor=auto: the largest of {', '.join(GEOMETRIES)}"

    def choose(self, models: Any) -> None:
        """Follow the upstream's `GET /v1/models` answer, if it serves a known family."""
        names = served_names(models)
        name = family(names)
        if name is None:
            return
        self.chosen = get_geometry(name)
        self.model = names[0] if names else None
        logger.info("media.processor auto: %s, for the upstream's model %s", name, self.model)

    async def detect(self, session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> None:
        """Ask the upstream (`url`: its `/v1/models`) while `auto` has not chosen; a failure leaves it undecided."""
        if not self.deciding:
            return
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                if response.status != 200:
                    return
                models = orjson.loads(await response.read())
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
            return
        self.choose(models)
