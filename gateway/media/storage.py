"""CPU storage of decoded media, counted once per underlying buffer.

torch tensors count their storage, NumPy arrays their base buffer, PIL images the pixel bytes Pillow holds; views
of one buffer count once. CUDA tensors are not CPU memory and are not counted. torch is optional here: the gateway runs
without it, and a tensor can only exist if torch is already imported.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np
from PIL import Image

from processor_geometry.rgb import pixel_size


def pil_pixel_bytes(image: Image.Image) -> int:
    """Bytes Pillow holds for the image's pixels: 4 a pixel for RGB, RGBA, LA, CMYK, I, F..., 2 for I;16, 1 for
    L, P and 1."""
    return mode_pixel_bytes(image.mode, image.width, image.height)


def mode_pixel_bytes(mode: str, width: int, height: int) -> int:
    """What `pil_pixel_bytes` will say once an image of this mode and size is decoded."""
    return width * height * pixel_size(mode)


class StorageCounter:
    """Adds each distinct CPU buffer once, however many objects view it.

    Buffers are recognized by address while the object that was counted is alive (a weak reference says so):
    an address reused after that object is freed belongs to new storage and counts again.
    """

    def __init__(self) -> None:
        self._seen: dict[Hashable, weakref.ref[Any]] = {}
        self.total = 0

    def add(self, obj: Any) -> int:
        """Count `obj` (or everything in a list, tuple or dict of them); returns the bytes newly counted."""
        added = 0
        for key, size, anchor in _storages(obj):
            seen = self._seen.get(key)
            if seen is None or seen() is None:
                self._seen[key] = weakref.ref(anchor)
                added += size
        self.total += added
        return added


Storage = tuple[Hashable, int, Any]  # (buffer identity, bytes, the live object that holds it)


def _storages(obj: Any) -> list[Storage]:
    if isinstance(obj, Image.Image):
        # PIL images never share pixel buffers; the image object is its own storage.
        return [(("pil", id(obj)), pil_pixel_bytes(obj), obj)]
    if isinstance(obj, np.ndarray):
        return [_numpy_storage(obj)]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            return []
        storage = obj.untyped_storage()
        return [(("torch", storage.data_ptr(), int(storage.nbytes())), int(storage.nbytes()), obj)]
    if isinstance(obj, list | tuple):
        return [entry for item in obj for entry in _storages(item)]
    if isinstance(obj, Mapping):
        return [entry for item in obj.values() for entry in _storages(item)]
    return []


def _numpy_storage(array: np.ndarray[Any, Any]) -> Storage:
    base = array
    while isinstance(base.base, np.ndarray):
        base = base.base
    owner = base.base
    if owner is None:
        return ("numpy", base.__array_interface__["data"][0], base.nbytes), base.nbytes, base
    # The array wraps a foreign buffer (bytes, mmap, a torch storage...): count the whole buffer.
    try:
        whole = np.frombuffer(owner, dtype=np.uint8)
    except (TypeError, ValueError):
        return ("numpy", base.__array_interface__["data"][0], base.nbytes), base.nbytes, base
    return ("buffer", whole.__array_interface__["data"][0], whole.nbytes), whole.nbytes, base
