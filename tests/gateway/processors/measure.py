"""The peak allocation of transformers' processors, measured in a process of their own.

That process runs with torchvision (the Makefile installs PyPI's torchvision 0.28.0, the release vLLM's CPU build
runs beside torch 2.13, into .venv/torchvision-overlay; only these processes put it on their path) and with
malloc_peak.c preloaded, which counts every byte the C allocator hands out (torch's tensors, NumPy's arrays,
Pillow's images, Python's larger objects): an item's peak is the most held during the processor's call beyond
what was held before it, its returned tensors included. The input (a Pillow RGB image, or a uint8 [t, h, w, 3]
clip, as vLLM passes them) is made before the call and is not part of it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
OVERLAY = ROOT / ".venv" / "torchvision-overlay"


def overlay_ready() -> bool:
    return (OVERLAY / "torchvision").is_dir()


def shim(build_dir: Path) -> Path:
    """malloc_peak.c compiled into `build_dir`."""
    out = build_dir / "malloc_peak.so"
    if not out.exists():
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(out), str(HERE / "malloc_peak.c")], check=True)
    return out


def measure(build_dir: Path, family: str, job: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """Run `job` (images: [[w, h]...], clips: [[t, w, h]...], requests: [[[w, h]...]...]) through `family`'s
    processors in a process of their own; returns each item's peak, returned bytes and tokens."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = str(shim(build_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(OVERLAY), str(ROOT)])
    env.setdefault("OMP_NUM_THREADS", "2")
    done = subprocess.run(
        [sys.executable, "-m", "tests.gateway.processors.measure", family],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring {family} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- the measuring process ---------------------------------------------------------------------------------


def _returned(out: Any) -> int:
    import torch

    return sum(v.untyped_storage().nbytes() for v in out.values() if isinstance(v, torch.Tensor))


def _run(lib: Any, call: Any) -> tuple[int, Any]:
    gc.collect()
    before = lib.malloc_peak_reset()
    out = call()
    return lib.malloc_peak_peak() - before, out


def main(family: str) -> None:
    import numpy as np
    from PIL import Image

    import tests.e2e.torchvision_cpu  # noqa: F401  (lets PyPI's torchvision import beside the CPU torch)
    from tests.gateway.processors.hf import build

    lib = ctypes.CDLL(None)
    for name in ("malloc_peak_reset", "malloc_peak_peak"):
        getattr(lib, name).restype = ctypes.c_longlong
    job = json.loads(sys.stdin.read())
    built = build(family)

    def image(w: int, h: int) -> Image.Image:
        return Image.new("RGB", (w, h), (200, 120, 40))

    def process_images(images: list[Image.Image]) -> Any:
        return built.image(images=images, return_tensors="pt")

    def process_clip(clip: Any) -> Any:
        return built.video(videos=[clip], return_tensors="pt", **(built.video_kwargs or {}))

    process_images([image(64, 48)])  # the first call's one-off allocations (imports, caches)
    if built.video is not None:
        process_clip(np.zeros((4, 48, 64, 3), np.uint8))
    result: dict[str, Any] = {"images": [], "clips": [], "requests": []}
    for w, h in job.get("images", []):
        img = image(w, h)
        peak, out = _run(lib, functools.partial(process_images, [img]))
        result["images"].append(
            {"size": [w, h], "peak": peak, "returned": _returned(out), "tokens": built.image_tokens(out)}
        )
        del out, img
    for t, w, h in job.get("clips", []) if built.video is not None else []:
        clip = np.full((t, h, w, 3), 90, np.uint8)
        peak, out = _run(lib, functools.partial(process_clip, clip))
        assert built.video_tokens is not None
        result["clips"].append(
            {"clip": [t, w, h], "peak": peak, "returned": _returned(out), "tokens": built.video_tokens(out)}
        )
        del out, clip
    for sizes in job.get("requests", []):
        imgs = [image(w, h) for w, h in sizes]
        peak, out = _run(lib, functools.partial(process_images, imgs))
        result["requests"].append({"sizes": sizes, "peak": peak, "returned": _returned(out)})
        del out, imgs
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
