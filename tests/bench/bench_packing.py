"""Host cost of packing selected encoder inputs across requests (run by hand, not in CI).

Seed-003 shapes: Qwen3-VL-like requests of 4 items (images of 16 patches; in the alternating case images and
videos of 32 patches alternate), 2 items selected per request, patch width 1536, bf16, one torch thread.
Selections: contiguous [0, 1], reordered [3, 1], alternating [0, 1] (one image and one video per request).

Paths, timed in interleaved rounds in one process (median of round means):
  packing            batch_encoder_inputs over prebuilt ItemRange entries, one per selected item
  packing/runs       the same with one entry per run of adjacent items (what plan.runs gives)
  selection+packing  building the per-item entries from the (request, item) work list, then packing
  naive              one slice and one torch.cat per item, then one torch.cat of the per-item copies
  per-item slices    one slice per item (no merging of adjacent items), then one torch.cat
  bare copy          torch.empty + copy_ of the same number of bytes from one contiguous tensor: the floor

    .venv/bin/python tests/bench/bench_packing.py [--rounds 13] [--calls 20] [--requests 64 128]
        [--fresh-pages]

Every path allocates its output afresh. glibc normally serves those allocations from memory it already
faulted in; --fresh-pages re-runs the process with MALLOC_MMAP_THRESHOLD_ fixed, so every large allocation
is a new mmap and the copy pays the page faults too (the "fresh memory" floor).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Run as a script, the repository root is not on sys.path; the package must come from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from encoder_scheduler import EncoderInputField, ItemRange, RequestInputs, batch_encoder_inputs

WIDTH = 1536
ITEMS_PER_REQUEST = 4
IMAGE_PATCHES = 16
VIDEO_PATCHES = 32
SELECTIONS = {"contiguous": (0, 1), "reordered": (3, 1), "alternating": (0, 1)}
PIXELS = EncoderInputField("pixel_values", ("pixel_values", "pixel_values_videos"))


def build_requests(num_requests: int, alternating: bool) -> list[RequestInputs]:
    generator = torch.Generator().manual_seed(13419)
    requests = []
    for _ in range(num_requests):
        pattern = ["image", "video"] if alternating else ["image", "image"]
        modalities = pattern * (ITEMS_PER_REQUEST // 2)
        image_rows = [IMAGE_PATCHES if m == "image" else 0 for m in modalities]
        video_rows = [VIDEO_PATCHES if m == "video" else 0 for m in modalities]
        tensors: dict[str, torch.Tensor | None] = {}
        item_rows: dict[str, list[int]] = {}
        for key, counts in (("pixel_values", image_rows), ("pixel_values_videos", video_rows)):
            if sum(counts):
                tensors[key] = torch.randn(sum(counts), WIDTH, generator=generator).to(torch.bfloat16)
                item_rows[key] = counts
        requests.append(RequestInputs.from_item_rows(tensors, item_rows))
    return requests


def item_slice(request: RequestInputs, index: int) -> torch.Tensor:
    for key, offsets in request.item_offsets.items():
        if offsets[index + 1] > offsets[index]:
            tensor = request.tensors[key]
            assert tensor is not None
            return tensor[offsets[index] : offsets[index + 1]]
    raise AssertionError("item without rows")


def make_paths(requests: list[RequestInputs], selection: tuple[int, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    work = [(r, i) for r in range(len(requests)) for i in selection]
    entries = [ItemRange(requests[r], i, i + 1) for r, i in work]
    runs: list[ItemRange] = []
    for r, i in work:
        if runs and runs[-1].request is requests[r] and runs[-1].stop == i:
            runs[-1] = ItemRange(requests[r], runs[-1].start, i + 1)
        else:
            runs.append(ItemRange(requests[r], i, i + 1))
    fields = [PIXELS]
    total_elements = sum(item_slice(requests[r], i).numel() for r, i in work)
    source = torch.randn(total_elements).to(torch.bfloat16)

    def packing() -> torch.Tensor:
        return batch_encoder_inputs(fields, entries)["pixel_values"]

    def packing_runs() -> torch.Tensor:
        return batch_encoder_inputs(fields, runs)["pixel_values"]

    def selection_packing() -> torch.Tensor:
        selected = [ItemRange(requests[r], i, i + 1) for r, i in work]
        return batch_encoder_inputs(fields, selected)["pixel_values"]

    def naive() -> torch.Tensor:
        return torch.cat([torch.cat([item_slice(requests[r], i)]) for r, i in work])

    def per_item_slices() -> torch.Tensor:
        return torch.cat([item_slice(requests[r], i) for r, i in work])

    def bare_copy() -> torch.Tensor:
        return torch.empty(total_elements, dtype=torch.bfloat16).copy_(source)

    expected = naive()
    for path in (packing, packing_runs, selection_packing, per_item_slices):
        assert torch.equal(path(), expected), path.__name__
    assert bare_copy().numel() == expected.numel()
    return {
        "packing": packing,
        "packing/runs": packing_runs,
        "selection+packing": selection_packing,
        "naive": naive,
        "per-item slices": per_item_slices,
        "bare copy": bare_copy,
    }


def measure(paths: dict[str, Callable[[], torch.Tensor]], rounds: int, calls: int) -> dict[str, float]:
    """Median over rounds of the mean ms per call; paths interleave within every round."""
    for path in paths.values():
        for _ in range(5):
            path()
    means: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    gc.disable()
    try:
        for round_index in range(rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
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
    parser.add_argument("--fresh-pages", action="store_true")
    args = parser.parse_args()
    if args.fresh_pages and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc reads it at start-up only; a fixed threshold also turns off its dynamic raising.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    torch.set_num_threads(1)
    pages = "fresh pages (MALLOC_MMAP_THRESHOLD_ fixed)" if "MALLOC_MMAP_THRESHOLD_" in os.environ else "reused"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread, {args.rounds} rounds x "
        f"{args.calls} calls, output memory: {pages}; median of round means, ms per call"
    )
    columns = ["packing", "packing/runs", "selection+packing", "naive", "per-item slices", "bare copy"]
    header = ["requests", "selection", "MiB", *columns, "packing/naive", "packing/bare", "sel+pack/bare"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for num_requests in args.requests:
        for name, selection in SELECTIONS.items():
            requests = build_requests(num_requests, alternating=name == "alternating")
            paths = make_paths(requests, selection)
            result = measure(paths, args.rounds, args.calls)
            mib = paths["naive"]().numel() * 2 / 2**20
            cells = [str(num_requests), name, f"{mib:.1f}", *(f"{result[column]:.3f}" for column in columns)]
            cells += [
                f"{result['packing'] / result['naive']:.2f}",
                f"{result['packing'] / result['bare copy']:.2f}",
                f"{result['selection+packing'] / result['bare copy']:.2f}",
            ]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
