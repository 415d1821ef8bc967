"""Qwen3-VL tower parity at a published width: ours against transformers' `Qwen3VLVisionModel` (eager), main output
and every DeepStack output, next to transformers' own sdpa-vs-eager difference. fp32 on the CPU, random weights
(the same seed for both), items through our processor.

    .venv/bin/python -m tests.bench.bench_qwen3_vl_parity [--preset qwen3-vl-2b] [--threads N]

Prints a markdown table: per case, the relative error (||ours - eager|| / ||eager||) of the main output and of each
DeepStack output, and sdpa's for the same outputs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from engine_adapter.models import get_preset
from engine_adapter.processor import process_image, process_video
from processor_geometry import QWEN3_VL
from tests.engine_adapter.test_qwen3_vl import make_towers, rel, split

CASES: dict[str, tuple[int, int, int]] = {
    # name: (frames, height, width) in pixels, at a smart-resized size (multiples of 32)
    "image 512x512": (1, 512, 512),
    "image 384x640 (landscape)": (1, 384, 640),
    "image 1024x224 (tall)": (1, 1024, 224),
    "image 256x256": (1, 256, 256),
    "video 4 x 256x320": (4, 256, 320),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-vl-2b")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = get_preset(args.preset)
    started = time.perf_counter()
    eager, sdpa, ours = make_towers(config)
    blocks = list(config.deepstack_visual_indexes)
    print(f"{config.name}: {config.depth} blocks of {config.hidden_size}, DeepStack {blocks}")
    print(f"built in {time.perf_counter() - started:.1f} s\n")
    layers = len(config.deepstack_visual_indexes)
    head = ["case", "grid", "main rel err", *(f"ds{k + 1} rel err" for k in range(layers))]
    head += ["sdpa vs eager (main)", *(f"sdpa vs eager (ds{k + 1})" for k in range(layers))]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, (frames, height, width) in CASES.items():
        pixels = np.random.default_rng(height * width + frames).integers(0, 256, (frames, height, width, 3), np.uint8)
        processed = process_image(pixels[0], QWEN3_VL) if frames == 1 else process_video(pixels, QWEN3_VL)
        x, grid = processed.pixel_values, processed.grid_thw
        with torch.inference_mode():
            expected, other, got = eager(x, grid), sdpa(x, grid), ours(x, grid)
        wanted = [expected.pooler_output, *expected.deepstack_features]
        reference = [other.pooler_output, *other.deepstack_features]
        mine = [rel(g, w) for g, w in zip(split(got, config), wanted, strict=True)]
        theirs = [rel(r, w) for r, w in zip(reference, wanted, strict=True)]
        grid_text = "x".join(map(str, grid[0].tolist()))
        print("| " + " | ".join([name, grid_text, *(f"{e:.2e}" for e in mine + theirs)]) + " |")


if __name__ == "__main__":
    main()
