"""What a vision-language model's image processor makes of pixels, without torch: the geometry an image or a clip
is resized to and cut into encoder rows (`qwen`, re-exported here), the rule that turns a decoded image into RGB
(`rgb`), and the resize kernel of transformers' torchvision processors (`resample`).

Both processes use it: the gateway to predict what a model server's processors hold (in proxy mode as in engine
mode) and, in engine mode, to resize before it sends pixels; the engine to patchify what it receives. It imports
neither of them, nor `serving`. Importing the package loads the standard library only: `rgb` needs Pillow and
`resample` NumPy, each loaded where it is imported.
"""

from __future__ import annotations

from processor_geometry.qwen import (
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

__all__ = [
    "GEOMETRIES",
    "QWEN2_5_VL",
    "QWEN2_VL",
    "QWEN3_VL",
    "RESIZES",
    "VIDEO_BOUNDS",
    "AspectRatioError",
    "ImageGeometry",
    "ProcessorGeometry",
    "get_geometry",
    "image_geometry",
    "resize_for_model",
    "resized_peak_bytes",
    "smart_resize",
    "video_geometry",
    "video_smart_resize",
]
