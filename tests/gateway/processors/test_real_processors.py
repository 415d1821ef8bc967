"""Every family's charge against transformers' own (torchvision) processor, built from the same configs, run on
images and a clip in a process of its own whose allocations are counted (measure.py): the token count is the
processor's, the returned tensors' bytes are its own, and the charge covers what it returns and stays within
1.0-1.3x its measured peak; a request of several images is charged what the processor holds for all of them at
once (`request_bytes`), within the same bounds. tests/bench/bench_processors.py runs the 12 sizes and 3 clips of
the docs' tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.processors import FAMILIES, load, request_bytes
from tests.gateway.processors.measure import measure, overlay_ready

IMAGES = [[1, 1], [1280, 720], [1080, 1920], [4000, 500]]
CLIPS = [[8, 640, 360]]
REQUESTS = [[[640, 480], [1280, 720], [1280, 720]]]
LOW, HIGH = 1.0, 1.3


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not overlay_ready():
        pytest.fail("torchvision for the processor measurements is not installed: make .venv/.installed-torchvision")
    return tmp_path_factory.mktemp("malloc_peak")


def _within(charge: int, measured: dict[str, Any], what: str) -> None:
    assert charge >= measured["returned"], f"{what}: charge {charge:,} under the returned {measured['returned']:,}"
    ratio = charge / measured["peak"]
    assert LOW <= ratio <= HIGH, f"{what}: charge {charge:,} is {ratio:.2f}x the measured peak {measured['peak']:,}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_charge_follows_the_real_processor(name: str, build_dir: Path) -> None:
    family = load(name)
    measured = measure(build_dir, name, {"images": IMAGES, "clips": CLIPS, "requests": REQUESTS})
    for item in measured["images"]:
        w, h = item["size"]
        made = family.image(h, w)
        assert [made.tokens] == item["tokens"], f"{name} {w}x{h}"
        assert made.returned == item["returned"], f"{name} {w}x{h}"
        _within(made.peak, item, f"{name} {w}x{h}")
    for item in measured["clips"]:
        t, w, h = item["clip"]
        clip = family.video(t, h, w)
        assert clip is not None
        assert [clip.tokens] == item["tokens"], f"{name} clip {t}x{w}x{h}"
        _within(clip.peak, item, f"{name} clip {t}x{w}x{h}")
    if family.video(8, 360, 640) is None:
        assert measured["clips"] == []  # transformers has no video processor for it either
    for item in measured["requests"]:
        charge = request_bytes([family.image(h, w) for w, h in item["sizes"]])
        _within(charge, item, f"{name} request {item['sizes']}")
