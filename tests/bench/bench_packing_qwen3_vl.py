"""Host cost of packing selected encoder inputs in the Qwen3-VL layout (run by hand, not in CI).

Requests of 4 items, patch rows of 1536 (3 x 2 x 16 x 16), bf16, one torch thread, 2 items selected per request:
contiguous [0, 1] and reordered [3, 1] (images of 16 patches), alternating [0, 1] (an image of 16 patches and a
video of 32 in each request). Each request holds Qwen3-VL's processor keys: `pixel_values` / `image_grid_thw`,
`pixel_values_videos` / `video_grid_thw`.

Paths, each producing the images-then-videos `pixel_values` and `grid_thw`, timed in interleaved rounds in one
process (median of round means):
  ours       batch_qwen3_vl_inputs over prebuilt ItemRange entries, one per selected item
  naive      per item: slice and copy (torch.cat of one) its rows and grid, split by modality, then one torch.cat
             of the copies per column
  torch.cat  one bare torch.cat per column over prebuilt per-item slices already in the final order: the floor

    .venv/bin/python tests/bench/bench_packing_qwen3_vl.py [--rounds 13] [--calls 20] [--requests 64 128]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Run as a script, the repository root is not on sys.path; the package must come from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from encoder_scheduler import ItemRange, RequestInputs, batch_qwen3_vl_inputs

WIDTH = 1536
ITEMS_PER_REQUEST = 4
IMAGE_PATCHES = 16  # grid 1 x 4 x 4
VIDEO_PATCHES = 32  # grid 2 x 4 x 4
SELECTIONS = {"contiguous": (0, 1), "reordered": (3, 1), "alternating": (0, 1)}
KEYS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
GRIDS = {"image": (1, 4, 4), "video": (2, 4, 4)}

Packed = tuple[torch.Tensor, torch.Tensor]


def build_requests(num_requests: int, alternating: bool) -> tuple[list[RequestInputs], list[list[str]]]:
    generator = torch.Generator().manual_seed(13419)
    requests, modalities_of = [], []
    for _ in range(num_requests):
        modalities = (["image", "video"] if alternating else ["image", "image"]) * (ITEMS_PER_REQUEST // 2)
        tensors: dict[str, torch.Tensor | None] = {}
        item_rows: dict[str, list[int]] = {}
        for modality, (pixel_key, grid_key) in KEYS.items():
            count = modalities.count(modality)
            if not count:
                continue
            patches = IMAGE_PATCHES if modality == "image" else VIDEO_PATCHES
            tensors[pixel_key] = torch.randn(count * patches, WIDTH, generator=generator).to(torch.bfloat16)
            tensors[grid_key] = torch.tensor([GRIDS[modality]] * count, dtype=torch.int64)
            item_rows[pixel_key] = [patches if m == modality else 0 for m in modalities]
            item_rows[grid_key] = [1 if m == modality else 0 for m in modalities]
        requests.append(RequestInputs.from_item_rows(tensors, item_rows))
        modalities_of.append(modalities)
    return requests, modalities_of


def item_slices(request: RequestInputs, modality: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for key in KEYS[modality]:
        tensor, offsets = request.tensors[key], request.item_offsets[key]
        assert tensor is not None
        out.append(tensor[offsets[index] : offsets[index + 1]])
    return out[0], out[1]


def make_paths(
    requests: list[RequestInputs], modalities_of: list[list[str]], selection: tuple[int, ...]
) -> dict[str, Callable[[], Packed]]:
    work = [(r, i) for r in range(len(requests)) for i in selection]
    entries = [ItemRange(requests[r], i, i + 1) for r, i in work]
    ordered = [(r, i) for modality in KEYS for r, i in work if modalities_of[r][i] == modality]
    final = [item_slices(requests[r], modalities_of[r][i], i) for r, i in ordered]
    final_pixels = [pixels for pixels, _ in final]
    final_grids = [grids for _, grids in final]

    def ours() -> Packed:
        tensors = batch_qwen3_vl_inputs(entries).tensors
        return tensors["pixel_values"], tensors["grid_thw"]

    def naive() -> Packed:
        split: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {m: ([], []) for m in KEYS}
        for r, i in work:
            modality = modalities_of[r][i]
            pixels, grids = item_slices(requests[r], modality, i)
            split[modality][0].append(torch.cat([pixels]))
            split[modality][1].append(torch.cat([grids]))
        return (
            torch.cat(split["image"][0] + split["video"][0]),
            torch.cat(split["image"][1] + split["video"][1]),
        )

    def bare_cat() -> Packed:
        return torch.cat(final_pixels), torch.cat(final_grids)

    expected = naive()
    for path in (ours, bare_cat):
        got = path()
        assert torch.equal(got[0], expected[0]), path.__name__
        assert torch.equal(got[1], expected[1]), path.__name__
    return {"naive": naive, "ours": ours, "torch.cat": bare_cat}


def measure(paths: dict[str, Callable[[], Packed]], rounds: int, calls: int) -> dict[str, float]:
    """Median over rounds of the mean ms per call; paths interleave within every round."""
    for path in paths.values():
        for _ in range(5):
            path()
    means: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    gc.disable()
    try:
        for round_index in range(rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                path = paths[name]
                start = time.perf_counter_ns()
                for _ in range(calls):
                    path()
                means[name].append((time.perf_counter_ns() - start) / calls / 1e6)
    finally:
        gc.enable()
    return {name: statistics.median(values) for name, values in means.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread, {args.rounds} rounds x {args.calls} calls; "
        "median of round means, ms per call"
    )
    header = ["requests", "selection", "items", "MiB", "naive", "ours", "torch.cat", "ours/naive", "ours/torch.cat"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for num_requests in args.requests:
        for name, selection in SELECTIONS.items():
            requests, modalities_of = build_requests(num_requests, alternating=name == "alternating")
            paths = make_paths(requests, modalities_of, selection)
            result = measure(paths, args.rounds, args.calls)
            mib = paths["naive"]()[0].numel() * 2 / 2**20
            cells = [str(num_requests), name, str(num_requests * len(selection)), f"{mib:.1f}"]
            cells += [f"{result[column]:.3f}" for column in ("naive", "ours", "torch.cat")]
            cells += [f"{result['ours'] / result['naive']:.2f}", f"{result['ours'] / result['torch.cat']:.2f}"]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
