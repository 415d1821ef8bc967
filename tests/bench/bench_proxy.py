"""Proxy overhead, side by side in one run on loopback: direct vs through the gateway vs through nginx.

    .venv/bin/python tests/bench/bench_proxy.py [--seconds 10] [--rounds 3]

Needs Debian's nginx and wrk (`apt-get install nginx-light wrk`). The fast upstream is an nginx server block
that answers a fixed small JSON body, so the upstream costs almost nothing; nginx as a plain reverse proxy
(keep-alive to the upstream) is the reference. Latency: wrk with one connection (p50/p99); throughput: wrk
with 16 connections. Rounds interleave the three targets; the table reports medians across rounds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BODY = b'{"model":"m","messages":[{"role":"user","content":"Say hi in one word."}],"max_tokens":8}'
ANSWER = '{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"}}]}'

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    upstream fast {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{upstream_port};
        access_log off;
        location / {{ default_type application/json; return 200 '{answer}'; }}
    }}
    server {{
        listen 127.0.0.1:{proxy_port};
        location / {{
            proxy_pass http://fast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def to_ms(value: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", value).groups()  # type: ignore[union-attr]
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def wrk(url: str, script: Path, connections: int, seconds: int) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"errors while benchmarking {url}:\n{out}")
    result = {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "requests": float(re.search(r"(\d+) requests in", out).group(1)),  # type: ignore[union-attr]
    }
    for pct in ("50", "99"):
        result[f"p{pct}"] = to_ms(re.search(rf"\s{pct}(?:\.000)?%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: apt-get install nginx-light wrk")
    tmp = Path(tempfile.mkdtemp(prefix="mmgate-bench-"))
    upstream_port, proxy_port, gateway_port = free_port(), free_port(), free_port()
    (tmp / "nginx.conf").write_text(
        NGINX_CONF.format(tmp=tmp, upstream_port=upstream_port, proxy_port=proxy_port, answer=ANSWER)
    )
    script = tmp / "post.lua"
    script.write_text(WRK_SCRIPT.format(body=BODY.decode()))
    (tmp / "gateway.yaml").write_text(
        f"upstream:\n  url: http://127.0.0.1:{upstream_port}\nserver:\n  port: {gateway_port}\n  log_level: warning\n"
    )
    nginx = subprocess.Popen(["nginx", "-c", str(tmp / "nginx.conf"), "-p", str(tmp)])
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--config", str(tmp / "gateway.yaml")],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,  # the access log is still formatted and written, like nginx's
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        for port in (upstream_port, proxy_port, gateway_port):
            wait_port(port)
        targets = {
            "direct": f"http://127.0.0.1:{upstream_port}/v1/chat/completions",
            "nginx": f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
            "gateway": f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
        }
        for url in targets.values():  # warm-up
            wrk(url, script, 4, 2)
        latency: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
        throughput: dict[str, list[float]] = {name: [] for name in targets}
        for _ in range(args.rounds):
            for name, url in targets.items():
                latency[name].append(wrk(url, script, 1, args.seconds))
                throughput[name].append(wrk(url, script, 16, args.seconds)["rps"])
        med = {
            name: {
                "p50": statistics.median(r["p50"] for r in latency[name]),
                "p99": statistics.median(r["p99"] for r in latency[name]),
                "rps1": statistics.median(r["rps"] for r in latency[name]),
                "rps16": statistics.median(throughput[name]),
            }
            for name in targets
        }
        print(f"\nproxy overhead, {args.rounds} interleaved rounds x {args.seconds}s, medians; body {len(BODY)} B\n")
        print("| path | req/s (1 conn) | req/s (16 conn) | p50 ms | p99 ms | added p50 ms | added p99 ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, m in med.items():
            added50 = m["p50"] - med["direct"]["p50"]
            added99 = m["p99"] - med["direct"]["p99"]
            print(
                f"| {name} | {m['rps1']:,.0f} | {m['rps16']:,.0f} | {m['p50']:.3f} | {m['p99']:.3f} | "
                f"{added50:.3f} | {added99:.3f} |"
            )
        nginx_added = med["nginx"]["p50"] - med["direct"]["p50"]
        gateway_added = med["gateway"]["p50"] - med["direct"]["p50"]
        print(
            f"\ngateway added p50 {gateway_added:.3f} ms (target <= 1 ms); "
            f"{gateway_added / nginx_added if nginx_added > 0 else float('inf'):.2f}x nginx's {nginx_added:.3f} ms "
            "(target <= 2x)"
        )
    finally:
        gateway.send_signal(signal.SIGTERM)
        nginx.send_signal(signal.SIGQUIT)
        gateway.wait(timeout=30)
        nginx.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
