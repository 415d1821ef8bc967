from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from gateway.media.storage import StorageCounter, mode_pixel_bytes, pil_pixel_bytes


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
    assert pil_pixel_bytes(rgb) == 40 * 30 * 4  # Pillow holds RGB in 4 bytes a pixel
    assert counter.add(rgb) == 4800
    assert counter.add(rgb) == 0
    assert counter.add(Image.new("RGBA", (10, 10))) == 400
    assert counter.add(Image.new("LA", (10, 10))) == 400
    assert counter.add(Image.new("L", (10, 10))) == 100
    assert counter.add(Image.new("1", (10, 10))) == 100
    assert counter.add(Image.new("I;16", (10, 10))) == 200
    assert counter.add(Image.new("F", (10, 10))) == 400


# Allocates one 2000 x 2000 image of each mode, keeping them all, and prints how much the resident size grew
# for each (Image.new fills the pixels, so every page is touched).
_STORAGE_SCRIPT = """
import json, os, sys
from PIL import Image

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

kept, grown = [], {}
for mode in sys.argv[1:]:
    Image.new(mode, (8, 8), 1)
    before = resident()
    kept.append(Image.new(mode, (2000, 2000), 1))
    grown[mode] = resident() - before
print(json.dumps(grown))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident size from /proc")
@pytest.mark.slow
def test_pil_pixel_bytes_is_what_pillow_allocates() -> None:
    modes = ["RGB", "RGBA", "LA", "PA", "CMYK", "YCbCr", "I", "F", "I;16", "L", "P", "1"]
    done = subprocess.run([sys.executable, "-c", _STORAGE_SCRIPT, *modes], capture_output=True, text=True, check=True)
    for mode, grown in json.loads(done.stdout).items():
        counted = mode_pixel_bytes(mode, 2000, 2000)
        assert abs(grown - counted) <= 0.02 * counted, (mode, grown, counted)


def test_containers_and_cuda_free_objects() -> None:
    counter = StorageCounter()
    array = np.zeros(10, dtype=np.float64)
    assert counter.add({"a": [array, array[2:]], "b": (Image.new("RGB", (2, 2)), "text", 7)}) == 80 + 16


def test_mode_pixel_bytes_predicts_pil() -> None:
    for mode in ("RGB", "RGBA", "L", "LA", "I;16", "F", "CMYK", "P", "1"):
        image = Image.new(mode, (13, 7))
        assert mode_pixel_bytes(mode, 13, 7) == pil_pixel_bytes(image), mode


def test_an_address_reused_after_free_counts_again() -> None:
    counter = StorageCounter()
    for _ in range(20):
        # Each image is freed (reference counting) before the next is made: their ids and buffers are reused.
        assert counter.add(Image.new("RGB", (8, 8))) == 256
        assert counter.add(np.zeros(64, dtype=np.uint8)) == 64
    assert counter.total == 20 * (256 + 64)
