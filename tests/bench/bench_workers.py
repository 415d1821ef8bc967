"""Scale-out, side by side in one run on loopback (by hand, not in CI):

1. Small chat POSTs: direct to the upstream, through nginx, through a bare aiohttp ASGI proxy (below: the floor for
   a Python proxy, uvicorn + httptools + uvloop + one aiohttp session, nothing else), and through the gateway with 1
   and with 2 workers (`--workers`), and with 1 worker logging every request at `log_level: info` (the production
   default; the access log goes to /dev/null). Latency: wrk with one connection (p50/p99); throughput: wrk with 16.
   The cost of a request is also read from the CPU time the proxy's processes (a gateway's supervisor and workers)
   spent while wrk ran, divided by the requests answered: on a machine where wrk, the upstream and the proxies
   share few cores, that is steadier than a throughput ratio, and it shows how many cores a proxy got.
2. Media admission overhead per request: the same chat POST with one small image through a 1-worker gateway with
   `limits.budget_backend: local` and with `redis` (a redis-server on loopback); the difference of the p50s is what
   the Redis round trips add to a media request. A 2-worker gateway on the Redis budget shows how workers scale
   where the gateway, not wrk and nginx, is what the cores run (a media request costs it several times theirs).

    .venv/bin/python tests/bench/bench_workers.py [--seconds 5] [--rounds 2] [--baseline DIR] [--only chat|media]

`--baseline DIR` serves a second checkout (another revision: `git archive REV | tar -x -C DIR`) as "gateway
(baseline)" rows next to this checkout's, with the same configs, so a change is measured against what it changed
in one run. `--only chat` / `--only media` runs part 1 / part 2 alone.

Needs Debian's nginx, wrk and redis-server. The upstream is an nginx server block answering a fixed small JSON
body. Rounds interleave the targets; the tables report medians across rounds. On a machine with few cores, wrk, the
upstream and the proxies compete for them: the table prints the core count and the cores each proxy used.
"""

from __future__ import annotations

import argparse
import base64
import io
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
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


def gateway_config(
    path: Path,
    upstream_port: int,
    port: int,
    *,
    backend: str = "local",
    redis_url: str = "",
    log_level: str = "warning",
) -> Path:
    text = (
        f"upstream:\n  url: http://127.0.0.1:{upstream_port}\nserver:\n  port: {port}\n  log_level: {log_level}\n"
        f"limits:\n  budget_backend: {backend}\n  max_multimodal_cpu_bytes: 4GiB\n"
        f"  max_multimodal_cpu_bytes_per_request: 512MiB\n"
    )
    if redis_url:
        text += f"redis:\n  url: {redis_url}\n  key_prefix: bench\n"
    path.write_text(text)
    return path


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and every process below it, from /proc."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        total += cpu.get(current, 0.0)
        stack.extend(child for child, parent in parents.items() if parent == current)
    return total


@dataclass
class Target:
    name: str
    port: int
    pid: int | None = None  # whose process tree's CPU time is counted
    samples: list[dict[str, float]] = field(default_factory=list)

    def run(self, script: Path, connections: int, seconds: int) -> dict[str, float]:
        before = tree_cpu_s(self.pid) if self.pid is not None else 0.0
        result = wrk(f"http://127.0.0.1:{self.port}/v1/chat/completions", script, connections, seconds)
        if self.pid is not None:
            spent = tree_cpu_s(self.pid) - before
            result["cpu_us"] = spent / result["requests"] * 1e6
            result["cores"] = spent / seconds
        return result

    def round(self, script: Path, seconds: int) -> None:
        latency = self.run(script, 1, seconds)
        throughput = self.run(script, 16, seconds)
        self.samples.append(
            {
                "p50": latency["p50"],
                "p99": latency["p99"],
                "rps1": latency["rps"],
                "rps16": throughput["rps"],
                "cpu1": latency.get("cpu_us", math.nan),
                "cpu16": throughput.get("cpu_us", math.nan),
                "cores16": throughput.get("cores", math.nan),
            }
        )

    def median(self, key: str) -> float:
        return statistics.median(sample[key] for sample in self.samples)


def table(targets: list[Target], bare: Target | None) -> None:
    print(
        "| path | req/s (1 conn) | req/s (16 conn) | p50 ms | p99 ms | CPU us/req (1 conn) | CPU us/req (16 conn) "
        "| cores used (16 conn) | CPU/req vs bare (1 conn) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for target in targets:
        m = {key: target.median(key) for key in target.samples[0]}
        ratio = m["cpu1"] / bare.median("cpu1") if bare is not None and target is not bare else math.nan
        cells = [f"{m['rps1']:,.0f}", f"{m['rps16']:,.0f}", f"{m['p50']:.3f}", f"{m['p99']:.3f}"]
        cells += ["" if math.isnan(m[key]) else f"{m[key]:,.0f}" for key in ("cpu1", "cpu16")]
        cells += [
            "" if math.isnan(m["cores16"]) else f"{m['cores16']:.2f}",
            "" if math.isnan(ratio) else f"{ratio:.2f}x",
        ]
        print(f"| {target.name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision, served next to this one")
    parser.add_argument("--only", choices=("chat", "media"), help="run only the chat rows or only the media rows")
    args = parser.parse_args()
    for tool in ("nginx", "wrk", "redis-server"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: apt-get install nginx-light wrk redis-server")
    tmp = Path(tempfile.mkdtemp(prefix="mmgate-bench-workers-"))
    upstream_port, nginx_port, bare_port, redis_port = free_port(), free_port(), free_port(), free_port()
    (tmp / "nginx.conf").write_text(
        NGINX_CONF.format(tmp=tmp, upstream_port=upstream_port, proxy_port=nginx_port, answer=ANSWER)
    )
    chat = tmp / "chat.lua"
    chat.write_text(WRK_SCRIPT.format(body=BODY.decode()))
    media = tmp / "media.lua"
    media.write_text(WRK_SCRIPT.format(body=media_body().decode()))
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    processes = [
        subprocess.Popen(["nginx", "-c", str(tmp / "nginx.conf"), "-p", str(tmp)]),
        subprocess.Popen(
            ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        ),
    ]
    bare_proxy = subprocess.Popen(
        [sys.executable, "-c", BARE_PROXY, f"http://127.0.0.1:{upstream_port}", str(bare_port)]
    )
    processes.append(bare_proxy)

    def gateway(
        name: str, workers: int, backend: str = "local", tree: Path = ROOT, log_level: str = "warning"
    ) -> Target:
        port = free_port()
        config = gateway_config(
            tmp / f"gw-{port}.yaml", upstream_port, port, backend=backend, redis_url=redis_url, log_level=log_level
        )
        env = {**os.environ, "PYTHONPATH": str(tree)}
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--config", str(config), "--workers", str(workers)],
            stdout=subprocess.DEVNULL,  # the access log (one JSON line a request at info)
            cwd=tree,
            env=env,
        )
        processes.append(process)
        return Target(name, port, process.pid)

    baseline = args.baseline.resolve() if args.baseline else None
    bare = Target("bare aiohttp proxy", bare_port, bare_proxy.pid)
    chat_targets: list[Target] = []
    if args.only != "media":
        chat_targets = [Target("direct", upstream_port), Target("nginx", nginx_port), bare]
        if baseline is not None:
            chat_targets.append(gateway("gateway (baseline), 1 worker", 1, tree=baseline))
            chat_targets.append(
                gateway("gateway (baseline), 1 worker, access log (info)", 1, tree=baseline, log_level="info")
            )
        one = gateway("gateway, 1 worker", 1)
        logged = gateway("gateway, 1 worker, access log (info)", 1, log_level="info")
        two = gateway("gateway, 2 workers", 2)
        chat_targets += [one, logged, two]
    media_targets = []
    if args.only != "chat":
        if baseline is not None:
            media_targets += [
                gateway("local (baseline)", 1, tree=baseline),
                gateway("redis (baseline)", 1, "redis", tree=baseline),
            ]
        local, shared = gateway("local, 1 worker", 1), gateway("redis, 1 worker", 1, "redis")
        shared_two = gateway("redis, 2 workers", 2, "redis")
        media_targets += [local, shared, shared_two]
    try:
        for target in (*chat_targets, *media_targets):
            wait_port(target.port)
        wait_port(redis_port)
        for target in chat_targets:
            wrk(f"http://127.0.0.1:{target.port}/v1/chat/completions", chat, 4, 2)
        for target in media_targets:
            wrk(f"http://127.0.0.1:{target.port}/v1/chat/completions", media, 4, 2)
        for _ in range(args.rounds):
            for target in chat_targets:
                target.round(chat, args.seconds)
            for target in media_targets:
                target.round(media, args.seconds)
        print(
            f"\n{os.cpu_count()} cores; {args.rounds} interleaved rounds x {args.seconds}s, medians; "
            f"chat body {len(BODY)} B, media body {len(media_body())} B (one 64x64 JPEG); CPU: the proxy's "
            "processes' user + system time while wrk ran, per request answered\n"
        )
        if chat_targets:
            table(chat_targets, bare)
            scale = two.median("rps16") / one.median("rps16")
            per_core = (two.median("rps16") / two.median("cores16")) / (one.median("rps16") / one.median("cores16"))
            print(
                f"\n2 workers / 1 worker throughput: {scale:.2f}x (target >= 1.7x), with "
                f"{two.median('cores16'):.2f} / {one.median('cores16'):.2f} cores used; per core used: {per_core:.2f}x"
            )
            for label, target in (("1 worker", one), ("1 worker with the access log", logged)):
                print(
                    f"{label}: CPU per request vs the bare aiohttp proxy: "
                    f"{target.median('cpu1') / bare.median('cpu1'):.2f}x at 1 connection, "
                    f"{target.median('cpu16') / bare.median('cpu16'):.2f}x at 16 (target <= 1.3x with the access log)"
                )
        if not media_targets:
            return
        print("\nmedia budget backend:\n")
        table(media_targets, None)
        added = shared.median("p50") - local.median("p50")
        print(f"\nRedis admission adds {added:.3f} ms p50 per media request (target <= 0.3 ms)")
        # A media request costs the gateway several times what it costs wrk and nginx, so here the workers, not
        # the load generator, are what the cores run.
        print(
            f"media, Redis budget: 2 workers / 1 worker throughput: "
            f"{shared_two.median('rps16') / shared.median('rps16'):.2f}x, with "
            f"{shared_two.median('cores16'):.2f} / {shared.median('cores16'):.2f} cores used"
        )
        if baseline is not None:
            base_local, base_shared = media_targets[0], media_targets[1]
            print(f"baseline: Redis admission adds {base_shared.median('p50') - base_local.median('p50'):.3f} ms p50")
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
