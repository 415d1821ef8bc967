"""Scale-out, side by side in one run on loopback (by hand, not in CI):

1. Small chat POSTs: direct to the upstream, through nginx, through a bare aiohttp ASGI proxy (below: the floor for
   a Python proxy, uvicorn + httptools + uvloop + one aiohttp session, nothing else), and through the gateway with 1
   and with 2 workers (`--workers`). Latency: wrk with one connection (p50/p99); throughput: wrk with 16.
2. Media admission overhead per request: the same small-image chat POST through a 1-worker gateway with
   `limits.budget_backend: local` and with `redis` (a redis-server on loopback); the difference of the p50s is what
   the Redis round trips add to a media request.

    .venv/bin/python tests/bench/bench_workers.py [--seconds 5] [--rounds 2]

Needs Debian's nginx, wrk and redis-server. The upstream is an nginx server block answering a fixed small JSON
body. Rounds interleave the targets; the tables report medians across rounds. On a machine with few cores, wrk, the
upstream and the proxies compete for them: the table prints the core count.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from PIL import Image

from tests.bench.bench_proxy import ANSWER, BODY, NGINX_CONF, WRK_SCRIPT, free_port, wait_port, wrk

ROOT = Path(__file__).resolve().parents[2]

BARE_PROXY = """
import sys
import aiohttp
import uvicorn

UPSTREAM = sys.argv[1]
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"host", b"content-length"}
session = None


async def app(scope, receive, send):
    global session
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
                await send({"type": "lifespan.startup.complete"})
            else:
                await session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = {k.decode(): v.decode() for k, v in scope["headers"] if k not in HOP}
    async with session.request(scope["method"], UPSTREAM + scope["path"], headers=headers, data=body) as response:
        out = [(k.lower().encode(), v.encode()) for k, v in response.headers.items()
               if k.lower().encode() not in HOP]
        await send({"type": "http.response.start", "status": response.status, "headers": out})
        async for chunk in response.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), http="httptools", loop="uvloop", log_level="warning",
            access_log=False)
"""


def media_body() -> bytes:
    image = Image.new("RGB", (64, 64), (120, 30, 200))
    out = io.BytesIO()
    image.save(out, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()
    return (
        '{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"What is it?"},'
        '{"type":"image_url","image_url":{"url":"' + url + '"}}]}],"max_tokens":8}'
    ).encode()


def gateway_config(path: Path, upstream_port: int, port: int, *, backend: str = "local", redis_url: str = "") -> Path:
    text = (
        f"upstream:\n  url: http://127.0.0.1:{upstream_port}\nserver:\n  port: {port}\n  log_level: warning\n"
        f"limits:\n  budget_backend: {backend}\n  max_multimodal_cpu_bytes: 4GiB\n"
        f"  max_multimodal_cpu_bytes_per_request: 512MiB\n"
    )
    if redis_url:
        text += f"redis:\n  url: {redis_url}\n  key_prefix: bench\n"
    path.write_text(text)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for tool in ("nginx", "wrk", "redis-server"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: apt-get install nginx-light wrk redis-server")
    tmp = Path(tempfile.mkdtemp(prefix="mmgate-bench-workers-"))
    upstream_port, nginx_port, bare_port = free_port(), free_port(), free_port()
    gw1_port, gw2_port, gw_local_port, gw_redis_port, redis_port = (free_port() for _ in range(5))
    (tmp / "nginx.conf").write_text(
        NGINX_CONF.format(tmp=tmp, upstream_port=upstream_port, proxy_port=nginx_port, answer=ANSWER)
    )
    chat = tmp / "chat.lua"
    chat.write_text(WRK_SCRIPT.format(body=BODY.decode()))
    media = tmp / "media.lua"
    media.write_text(WRK_SCRIPT.format(body=media_body().decode()))
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    quiet = {"stdout": subprocess.DEVNULL, "cwd": ROOT, "env": env}
    processes = [
        subprocess.Popen(["nginx", "-c", str(tmp / "nginx.conf"), "-p", str(tmp)]),
        subprocess.Popen(
            ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        ),
        subprocess.Popen([sys.executable, "-c", BARE_PROXY, f"http://127.0.0.1:{upstream_port}", str(bare_port)]),
    ]
    gateway = [sys.executable, "-m", "gateway", "--config"]
    for port, workers, backend in (
        (gw1_port, 1, "local"),
        (gw2_port, 2, "local"),
        (gw_local_port, 1, "local"),
        (gw_redis_port, 1, "redis"),
    ):
        config = gateway_config(tmp / f"gw-{port}.yaml", upstream_port, port, backend=backend, redis_url=redis_url)
        processes.append(subprocess.Popen([*gateway, str(config), "--workers", str(workers)], **quiet))  # type: ignore[call-overload]
    try:
        for port in (upstream_port, nginx_port, bare_port, redis_port, gw1_port, gw2_port, gw_local_port):
            wait_port(port)
        wait_port(gw_redis_port)
        path = "/v1/chat/completions"
        targets = {
            "direct": upstream_port,
            "nginx": nginx_port,
            "bare aiohttp proxy": bare_port,
            "gateway, 1 worker": gw1_port,
            "gateway, 2 workers": gw2_port,
        }
        media_targets = {"local": gw_local_port, "redis": gw_redis_port}
        for port in targets.values():
            wrk(f"http://127.0.0.1:{port}{path}", chat, 4, 2)
        for port in media_targets.values():
            wrk(f"http://127.0.0.1:{port}{path}", media, 4, 2)
        latency: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
        throughput: dict[str, list[float]] = {name: [] for name in targets}
        media_latency: dict[str, list[dict[str, float]]] = {name: [] for name in media_targets}
        media_throughput: dict[str, list[float]] = {name: [] for name in media_targets}
        for _ in range(args.rounds):
            for name, port in targets.items():
                url = f"http://127.0.0.1:{port}{path}"
                latency[name].append(wrk(url, chat, 1, args.seconds))
                throughput[name].append(wrk(url, chat, 16, args.seconds)["rps"])
            for name, port in media_targets.items():
                url = f"http://127.0.0.1:{port}{path}"
                media_latency[name].append(wrk(url, media, 1, args.seconds))
                media_throughput[name].append(wrk(url, media, 16, args.seconds)["rps"])
        print(
            f"\n{os.cpu_count()} cores; {args.rounds} interleaved rounds x {args.seconds}s, medians; "
            f"chat body {len(BODY)} B, media body {len(media_body())} B (one 64x64 JPEG)\n"
        )
        print("| path | req/s (1 conn) | req/s (16 conn) | p50 ms | p99 ms | CPU cost/req vs bare (16 conn) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        med = {}
        for name in targets:
            med[name] = {
                "p50": statistics.median(r["p50"] for r in latency[name]),
                "p99": statistics.median(r["p99"] for r in latency[name]),
                "rps1": statistics.median(r["rps"] for r in latency[name]),
                "rps16": statistics.median(throughput[name]),
            }
        bare = med["bare aiohttp proxy"]["rps16"]
        for name, m in med.items():
            workers = 2 if "2 workers" in name else 1
            ratio = bare / (m["rps16"] / workers) if "gateway" in name else float("nan")
            shown = f"{ratio:.2f}x" if ratio == ratio else ""
            print(f"| {name} | {m['rps1']:,.0f} | {m['rps16']:,.0f} | {m['p50']:.3f} | {m['p99']:.3f} | {shown} |")
        scale = med["gateway, 2 workers"]["rps16"] / med["gateway, 1 worker"]["rps16"]
        per_worker = bare / med["gateway, 1 worker"]["rps16"]
        print(f"\n2 workers / 1 worker throughput: {scale:.2f}x (target >= 1.7x)")
        print(f"1 worker's cost per request vs the bare aiohttp proxy: {per_worker:.2f}x (target <= 1.3x)")
        print("\n| media budget backend | req/s (1 conn) | req/s (16 conn) | p50 ms | p99 ms |")
        print("| --- | ---: | ---: | ---: | ---: |")
        mmed = {}
        for name in media_targets:
            mmed[name] = {
                "p50": statistics.median(r["p50"] for r in media_latency[name]),
                "p99": statistics.median(r["p99"] for r in media_latency[name]),
                "rps1": statistics.median(r["rps"] for r in media_latency[name]),
                "rps16": statistics.median(media_throughput[name]),
            }
            m = mmed[name]
            print(f"| {name} | {m['rps1']:,.0f} | {m['rps16']:,.0f} | {m['p50']:.3f} | {m['p99']:.3f} |")
        added = mmed["redis"]["p50"] - mmed["local"]["p50"]
        print(f"\nRedis admission adds {added:.3f} ms p50 per media request (target <= 0.3 ms)")
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
