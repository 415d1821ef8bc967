from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from gateway.storage import StorageCounter, mode_pixel_bytes, pil_pixel_bytes


def test_numpy_views_share_their_base() -> None:
    counter = StorageCounter()
    base = np.zeros((100, 100, 3), dtype=np.uint8)
    assert counter.add(base) == 30_000
    assert counter.add(base[10:20]) == 0
    assert counter.add(base.reshape(-1)[::2]) == 0
    assert counter.add(base.copy()) == 30_000
    assert counter.total == 60_000


def test_numpy_over_a_foreign_buffer_counts_the_buffer() -> None:
    buffer = bytearray(1000)
    counter = StorageCounter()
    view = np.frombuffer(buffer, dtype=np.uint8)[:10]
    assert counter.add(view) == 1000
    assert counter.add(np.frombuffer(buffer, dtype=np.uint8)[500:]) == 0


def test_torch_views_share_their_storage() -> None:
    counter = StorageCounter()
    tensor = torch.zeros(64, 64, dtype=torch.float32)
    assert counter.add(tensor) == 64 * 64 * 4
    assert counter.add(tensor[3:7]) == 0
    assert counter.add(tensor.t()) == 0
    assert counter.add(tensor.view(-1)) == 0
    assert counter.add(tensor.clone()) == 64 * 64 * 4


def test_numpy_from_torch_counts_once() -> None:
    tensor = torch.zeros(1000, dtype=torch.uint8)
    counter = StorageCounter()
    counter.add(tensor)
    # A NumPy view of a torch tensor holds the same memory, but nothing ties the two objects together:
    # a different owner, so counted again. Conservative, never under.
    assert counter.add(tensor.numpy()) in (0, 1000)


def test_pil_images_count_their_pixels() -> None:
    counter = StorageCounter()
    rgb = Image.new("RGB", (40, 30))
    assert pil_pixel_bytes(rgb) == 40 * 30 * 3
    assert counter.add(rgb) == 3600
    assert counter.add(rgb) == 0
    assert counter.add(Image.new("RGBA", (10, 10))) == 400
    assert counter.add(Image.new("L", (10, 10))) == 100
    assert counter.add(Image.new("I;16", (10, 10))) == 200
    assert counter.add(Image.new("F", (10, 10))) == 400


def test_containers_and_cuda_free_objects() -> None:
    counter = StorageCounter()
    array = np.zeros(10, dtype=np.float64)
    assert counter.add({"a": [array, array[2:]], "b": (Image.new("RGB", (2, 2)), "text", 7)}) == 80 + 12


def test_mode_pixel_bytes_predicts_pil() -> None:
    for mode in ("RGB", "RGBA", "L", "LA", "I;16", "F", "CMYK", "P", "1"):
        image = Image.new(mode, (13, 7))
        assert mode_pixel_bytes(mode, 13, 7) == pil_pixel_bytes(image), mode


def test_an_address_reused_after_free_counts_again() -> None:
    import gc

    counter = StorageCounter()
    for _ in range(20):
        # Each image is dropped before the next is made: their ids and buffers are reused.
        assert counter.add(Image.new("RGB", (8, 8))) == 192
        assert counter.add(np.zeros(64, dtype=np.uint8)) == 64
        gc.collect()
    assert counter.total == 20 * (192 + 64)
