"""The engine contract, without torch: the submit format (`wire`), the client the gateway calls the engine with
(`engine_client`), the model geometry both sides resize and count by (`geometry`) and the RGB conversion rule
(`rgb`). The gateway imports nothing else of `engine_adapter`; the HTTP plumbing both processes run on is the
`serving` package.

The names load on first use, so importing one module (`engine_adapter.client.geometry`: no numpy, no torch) does
not load the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_adapter.client import rgb
    from engine_adapter.client.engine_client import EngineClient, EngineRefusal
    from engine_adapter.client.geometry import (
        GEOMETRIES,
        QWEN2_5_VL,
        QWEN2_VL,
        QWEN3_VL,
        RESIZES,
        VIDEO_BOUNDS,
        AspectRatioError,
        ImageGeometry,
        ProcessorGeometry,
        get_geometry,
        image_geometry,
        resize_for_model,
        resized_peak_bytes,
        smart_resize,
        video_geometry,
        video_smart_resize,
    )
    from engine_adapter.client.rgb import conversion_bytes, pixel_size, to_rgb
    from engine_adapter.client.wire import (
        EMBEDDINGS_CONTENT_TYPE,
        ITEM_PART_TYPE,
        SUBMIT_CONTENT_TYPE,
        SubmitRequest,
        WireFormatError,
        WireItem,
        content_hash,
        decode_submit,
        encode_submit,
        item_part,
        read_metadata,
    )

__all__ = [
    "EMBEDDINGS_CONTENT_TYPE",
    "GEOMETRIES",
    "ITEM_PART_TYPE",
    "QWEN2_5_VL",
    "QWEN2_VL",
    "QWEN3_VL",
    "RESIZES",
    "SUBMIT_CONTENT_TYPE",
    "VIDEO_BOUNDS",
    "AspectRatioError",
    "EngineClient",
    "EngineRefusal",
    "ImageGeometry",
    "ProcessorGeometry",
    "SubmitRequest",
    "WireFormatError",
    "WireItem",
    "content_hash",
    "conversion_bytes",
    "decode_submit",
    "encode_submit",
    "get_geometry",
    "image_geometry",
    "item_part",
    "pixel_size",
    "read_metadata",
    "resize_for_model",
    "resized_peak_bytes",
    "rgb",
    "smart_resize",
    "to_rgb",
    "video_geometry",
    "video_smart_resize",
]

# Searched in this order: the numpy-free modules first, so that their names load neither numpy nor aiohttp.
_MODULES = ("geometry", "rgb", "wire", "engine_client")


def __getattr__(name: str) -> Any:
    if name in __all__:
        if name in _MODULES:
            return importlib.import_module(f"{__name__}.{name}")
        for home in _MODULES:
            module = vars(importlib.import_module(f"{__name__}.{home}"))
            if name in module:
                return module[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
