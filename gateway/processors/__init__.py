"""Which model server processor a request's media are charged for (`media.processor`), and what it holds.

A model server turns each image into tensors several times the decoded pixels, and while it does it holds more
than it returns (the uint8 copies it resizes from, the float32 image it normalizes, the patched copy); the gateway
charges that peak, so the budget protects the upstream's memory. One module per family (base.py says what each
models): Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V/4.5V, Gemma 3, Llama 4, InternVL 3, Pixtral, Mistral Small 3.1,
Phi-4-multimodal, LLaVA-OneVision, each configured from its published checkpoint's preprocessor configs (package
data in configs/<family>/).

`media.processor`: a family name, a model's config directory (its preprocessor_config.json and the others, which
name the family and give its parameters), `auto` (the default: the family of the model the upstream serves, from
its `GET /v1/models` by name (names.py), asked at start-up and at each readiness probe until answered; until then,
and for a model of no known family, every charge is the largest the known families would make), or `null`
(decoded pixels only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.errors import BadRequest
from gateway.processors.base import Family, Processed, read_config, request_bytes
from gateway.processors.gemma3 import Gemma3
from gateway.processors.glm4v import Glm4v
from gateway.processors.internvl import InternVL
from gateway.processors.llama4 import Llama4
from gateway.processors.llava_onevision import LlavaOnevision
from gateway.processors.names import family_of
from gateway.processors.phi4_multimodal import Phi4Multimodal
from gateway.processors.pixtral import Pixtral
from gateway.processors.qwen import Qwen

__all__ = [
    "AUTO",
    "FAMILIES",
    "Family",
    "Processed",
    "Processors",
    "largest",
    "load",
    "request_bytes",
    "served_names",
]

AUTO = "auto"
CONFIGS = Path(__file__).parent / "configs"
FAMILIES: dict[str, type[Any]] = {
    "qwen2_vl": Qwen,
    "qwen2_5_vl": Qwen,
    "qwen3_vl": Qwen,
    "glm4v": Glm4v,
    "gemma3": Gemma3,
    "llama4": Llama4,
    "internvl3": InternVL,
    "pixtral": Pixtral,
    "mistral3": Pixtral,
    "phi4_multimodal": Phi4Multimodal,
    "llava_onevision": LlavaOnevision,
}
# A model directory's family, by the processor class its configs name, else by config.json's model_type.
_BY_PROCESSOR_CLASS = {
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
    "Glm4vProcessor": "glm4v",
    "Gemma3Processor": "gemma3",
    "Llama4Processor": "llama4",
    "InternVLProcessor": "internvl3",
    "PixtralProcessor": "pixtral",
    "Phi4MultimodalProcessor": "phi4_multimodal",
    "LlavaOnevisionProcessor": "llava_onevision",
}
_BY_MODEL_TYPE = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "glm4v": "glm4v",
    "glm4v_moe": "glm4v",
    "gemma3": "gemma3",
    "llama4": "llama4",
    "internvl": "internvl3",
    "mistral3": "mistral3",
    "pixtral": "pixtral",
    "phi4_multimodal": "phi4_multimodal",
    "llava_onevision": "llava_onevision",
}

logger = logging.getLogger("mmgate.gateway")


def directory_family(directory: Path) -> str:
    """The family a model's config directory names; ValueError where it names none known."""
    if not (directory / "preprocessor_config.json").is_file():
        raise ValueError(f"{directory} has no preprocessor_config.json")
    for name in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        config = read_config(directory, name) or {}
        family = _BY_PROCESSOR_CLASS.get(str(config.get("processor_class")))
        if family == "pixtral" and int(config.get("spatial_merge_size", 1)) > 1:
            return "mistral3"
        if family is not None:
            return family
    model_type = str((read_config(directory, "config.json") or {}).get("model_type"))
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(
        f"{directory}: its configs name no known processor (processor_class or config.json's model_type); known: "
        f"{', '.join(sorted(_BY_PROCESSOR_CLASS))}"
    )


def load(setting: str) -> Family:
    """The family `setting` names: a family name (its published configs) or a model's config directory."""
    if setting in FAMILIES:
        family: Family = FAMILIES[setting].from_config(setting, CONFIGS / setting)
        return family
    directory = Path(setting).expanduser()
    if not directory.is_dir():
        raise ValueError(f"{setting!r} is neither a known processor ({', '.join(FAMILIES)}) nor a directory")
    name = directory_family(directory)
    loaded: Family = FAMILIES[name].from_config(name, directory)
    return loaded


def valid_setting(value: str | None) -> str | None:
    """`media.processor` checked: auto, null, a family, or a directory whose configs load."""
    if value is None or value == AUTO:
        return value
    load(value)
    return value


def served_names(models: Any) -> list[str]:
    """The ids and roots of the models in an OpenAI `GET /v1/models` answer."""
    data = models.get("data") if isinstance(models, dict) else None
    names: list[str] = []
    for model in data if isinstance(data, list) else []:
        if isinstance(model, dict):
            names += [value for key in ("root", "id") if isinstance(value := model.get(key), str)]
    return names


def family(names: Iterable[str]) -> str | None:
    """The family of the first of `names` that names one (names.py)."""
    return family_of(names)


def largest(
    families: Iterable[Family], make: Callable[[Family], Processed | None], locator: str, label: str
) -> Processed | None:
    """The largest peak `make` gives among the families that accept the item (an image too elongated for one,
    a clip shorter than a temporal patch for another), None where none has a processor for it; 400 naming
    `label` where every one refuses it."""
    made: list[Processed] = []
    problem: ValueError | None = None
    for one in families:
        try:
            result = make(one)
        except ValueError as exc:  # AspectRatioError among them
            problem = problem or exc
            continue
        if result is not None:
            made.append(result)
    if not made and problem is not None:
        raise BadRequest(f"{locator}: {problem} ({label})", reason="bad_media_geometry") from None
    return max(made, key=lambda result: result.peak, default=None)


_ALL: tuple[Family, ...] | None = None


def all_families() -> tuple[Family, ...]:
    """Every known family with its published configs (loaded once)."""
    global _ALL
    if _ALL is None:
        _ALL = tuple(load(name) for name in FAMILIES)
    return _ALL


class Processors:
    """The processors whose peaks are charged: the one `media.processor` names, the upstream's (`auto`, once it
    is known), or while `auto` does not know it every known one (the largest charge of them)."""

    def __init__(self, setting: str | None) -> None:
        self.setting = setting
        self.chosen: Family | None = None if setting in (None, AUTO) else load(setting)
        self.model: str | None = None  # the served model `auto` chose from
        self.unknown = False  # `auto`: the upstream serves a model of no known family

    @property
    def deciding(self) -> bool:
        """`auto` without an answer from the upstream yet."""
        return self.setting == AUTO and self.chosen is None and not self.unknown

    @property
    def candidates(self) -> tuple[Family, ...]:
        if self.setting is None:
            return ()
        return (self.chosen,) if self.chosen is not None else all_families()

    @property
    def label(self) -> str:
        """What a message names: `media.processor=qwen2_vl`, `media.processor=auto: gemma3`..."""
        if self.setting != AUTO:
            return f"media.processor={self.setting}"
        if self.chosen is not None:
            return f"media.processor=auto: {self.chosen.name}"
        return "media.processor=auto: the largest of the known families"

    def choose(self, models: Any) -> None:
        """Follow the upstream's `GET /v1/models` answer: its model's family, or, for a model of no known family,
        one warning and the conservative charge."""
        names = served_names(models)
        if not names:
            return
        self.model = names[0]
        name = family(names)
        if name is None:
            self.unknown = True
            logger.warning(
                "media.processor auto: the upstream's model %s is of no known family; every image and video is "
                "charged the largest of the known families' processors (set media.processor to its family or its "
                "config directory)",
                self.model,
            )
            return
        self.chosen = load(name)
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
