"""docs/sizing.md's numbers are the code's: the charge per image is what the gateway charges, the worked example's
config loads, its container limit passes the start-up check (and a smaller one does not), and its host arithmetic
adds up within the host."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gateway import memory_fit
from gateway.config import GatewaySettings
from gateway.processors import Processors
from gateway.processors.base import request_bytes
from serving.cgroup import MemoryLimit
from serving.settings_loader import ConfigError
from tests.servers import ROOT

SIZING = ROOT / "docs" / "sizing.md"
GIB = 1 << 30


def text() -> str:
    return SIZING.read_text(encoding="utf-8")


def table(heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the table whose header row starts with `heading`."""
    lines = text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {heading} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def example() -> tuple[GatewaySettings, int]:
    (block,) = re.findall(r"```yaml\n(# The worked example.*?)```", text(), re.DOTALL)
    limit = re.search(r"container limit (\d+)Gi", block)
    assert limit is not None
    return GatewaySettings(**yaml.safe_load(block)), int(limit.group(1)) * GIB


def test_the_charge_of_each_image_is_the_gateways() -> None:
    family = Processors("qwen2_5_vl").chosen
    assert family is not None
    for size, decoded, peak, charged in table("image | decoded"):
        width, height = (int(side) for side in size.split("x"))
        processor = request_bytes([family.image(height, width)])
        assert decoded == f"{width * height * 4 / 1e6:.1f} MB", size
        assert peak == f"{processor / 1e6:.1f} MB", size
        assert charged == f"{(width * height * 4 + processor) / 1e6:.1f} MB", size


def test_the_worked_example_fits_its_container_and_its_host() -> None:
    settings, container = example()
    needed = memory_fit.required_bytes(settings)
    assert needed is not None
    memory_fit.check(settings, MemoryLimit(container, Path("memory.max")))
    with pytest.raises(ConfigError, match=r"limits\.max_multimodal_cpu_bytes=16GiB"):
        memory_fit.check(settings, MemoryLimit(needed - 1, Path("memory.max")))
    rows = {part: float(gib) for part, gib in table("part | GiB")}
    total = rows.pop("total")
    assert sum(rows.values()) == pytest.approx(total)
    assert total <= 64
    gateway = sum(gib for part, gib in rows.items() if part.startswith("the gateway"))
    assert gateway * GIB == needed
    budget = settings.limits.max_multimodal_cpu_bytes
    assert budget is not None
    assert rows["the gateway: media budget"] * GIB == budget
    (growth,) = [gib for part, gib in rows.items() if part.startswith("vLLM's media")]
    assert growth == pytest.approx(1.7 * budget / GIB)
