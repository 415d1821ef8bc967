"""Slow and huge clients against a real gateway process, with the HTTP limits on and off, in one run on loopback.

    .venv/bin/python tests/bench/bench_slow_clients.py [--connections 300] [--seconds 8] [--rounds 1]

Each scenario opens `--connections` connections that are idle, trickle a request head, or trickle a request
body (one byte per interval, an interval shorter or longer than the body idle timeout), or sends a 64 MiB header
from 4 connections at full speed. While it runs, a probe opens a fresh connection for `/healthz` every 100 ms.
After `--seconds` the table shows how many of the connections are still open and the probe's median and worst
latency, medians across rounds. "limits" is the gateway with the timeouts of the flags below and the default
sizes; "off" has all five `server` limits null. No upstream is needed: only `/healthz` and refusals answer.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Run as a script, the repository root is not on sys.path; the package must come from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.servers import served_process

HUGE_BYTES = 64 << 20
HUGE_SENDERS = 4
PROBE_EVERY_S = 0.1


@dataclass
class Outcome:
    still_open: int
    probe_latencies: list[float] = field(default_factory=list)
    probe_failures: int = 0


def gateway_config(path: Path, *, limits: bool, header_timeout_s: float, body_idle_timeout_s: float) -> None:
    if limits:
        server = f"  header_timeout_s: {header_timeout_s}\n  body_idle_timeout_s: {body_idle_timeout_s}\n"
    else:
        keys = ("max_connections", "max_header_bytes", "max_headers", "header_timeout_s", "body_idle_timeout_s")
        server = "".join(f"  {key}: null\n" for key in keys)
    path.write_text(f"server:\n  access_log: false\n  log_level: warning\n{server}")


def probe(host: str, port: int, stop: threading.Event, outcome: Outcome) -> None:
    """`GET /healthz` on a fresh connection every PROBE_EVERY_S until `stop`."""
    while not stop.wait(PROBE_EVERY_S):
        started = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=30) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n")
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
            if not data.startswith(b"HTTP/1.1 200"):
                outcome.probe_failures += 1
                continue
        except OSError:
            outcome.probe_failures += 1
            continue
        outcome.probe_latencies.append(time.monotonic() - started)


async def slow_client(host: str, port: int, kind: str, interval_s: float, stop: asyncio.Event) -> bool:
    """One idle or trickling connection until `stop`; whether it was still open then."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    heads = {
        "idle": b"",
        "head": b"GET /healthz HTTP/1.1\r\nhost: bench\r\n",
        "body": b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: 1000000\r\n\r\n",
    }
    trickle = {"idle": b"", "head": b"x-slow: 1\r\n", "body": b"x"}[kind]
    closed = asyncio.Event()

    async def watch() -> None:
        try:
            while await reader.read(65536):
                pass
        except OSError:
            pass
        closed.set()

    watcher = asyncio.create_task(watch())
    try:
        writer.write(heads[kind])
        while not stop.is_set() and not closed.is_set():
            if trickle:
                writer.write(trickle)
                await writer.drain()
            waits = [asyncio.create_task(event.wait()) for event in (stop, closed)]
            _, pending = await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
    except OSError:
        closed.set()
    still_open = not closed.is_set()
    watcher.cancel()
    writer.close()
    return still_open


async def hold_slow_clients(host: str, port: int, kind: str, count: int, interval_s: float, seconds: float) -> int:
    stop = asyncio.Event()
    clients = []
    for _ in range(count):
        clients.append(asyncio.create_task(slow_client(host, port, kind, interval_s, stop)))
        await asyncio.sleep(0)
    await asyncio.sleep(seconds)
    stop.set()
    return sum(await asyncio.gather(*clients))


def huge_headers(host: str, port: int, seconds: float) -> int:
    """HUGE_SENDERS connections each sending a 64 MiB header; how many had sent it all and were still open."""
    results: list[bool] = []

    def send() -> None:
        block = b"a" * (1 << 20)
        try:
            with socket.create_connection((host, port), timeout=seconds) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: bench\r\nx-huge: ")
                for _ in range(HUGE_BYTES // len(block)):
                    sock.sendall(block)
                results.append(True)
        except OSError:
            results.append(False)

    senders = [threading.Thread(target=send) for _ in range(HUGE_SENDERS)]
    for sender in senders:
        sender.start()
    deadline = time.monotonic() + seconds
    for sender in senders:
        sender.join(max(0.0, deadline - time.monotonic()))
    time.sleep(max(0.0, deadline - time.monotonic()))
    return sum(results) + sum(sender.is_alive() for sender in senders)


def run_scenario(url: str, scenario: str, args: argparse.Namespace) -> Outcome:
    host, port = url.removeprefix("http://").split(":")
    outcome = Outcome(still_open=0)
    stop = threading.Event()
    prober = threading.Thread(target=probe, args=(host, int(port), stop, outcome))
    prober.start()
    try:
        if scenario == "huge":
            outcome.still_open = huge_headers(host, int(port), args.seconds)
        else:
            kind, _, pace = scenario.partition("-")
            interval_s = {"": 1.0, "fast": 1.0, "slow": args.body_idle_timeout + 1.0}[pace]
            outcome.still_open = asyncio.run(
                hold_slow_clients(host, int(port), kind, args.connections, interval_s, args.seconds)
            )
    finally:
        stop.set()
        prober.join()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each scenario holds its connections")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--header-timeout", type=float, default=2.0, help="server.header_timeout_s with limits")
    parser.add_argument("--body-idle-timeout", type=float, default=2.0, help="server.body_idle_timeout_s with limits")
    args = parser.parse_args()
    if args.connections > 1000 or args.seconds > 60 or args.rounds > 5:
        parser.error("bounded: at most 1000 connections, 60 seconds, 5 rounds")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.connections + 256)), hard))

    scenarios = ["idle", "head", "body-fast", "body-slow", "huge"]
    labels = {
        "idle": f"{args.connections} idle",
        "head": f"{args.connections} trickling a head (1 line/s)",
        "body-fast": f"{args.connections} trickling a body (1 B/s)",
        "body-slow": f"{args.connections} trickling a body (1 B/{args.body_idle_timeout + 1:g}s)",
        "huge": f"{HUGE_SENDERS} x 64 MiB header",
    }
    outcomes: dict[tuple[str, str], list[Outcome]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mode in ("limits", "off"):
                config = Path(tmp) / f"{mode}.yaml"
                gateway_config(
                    config,
                    limits=mode == "limits",
                    header_timeout_s=args.header_timeout,
                    body_idle_timeout_s=args.body_idle_timeout,
                )
                with served_process("gateway", config, "--upstream", "http://127.0.0.1:9") as served:
                    for scenario in scenarios:
                        print(f"round {round_ + 1}: {mode}: {labels[scenario]} ...", file=sys.stderr, flush=True)
                        outcomes.setdefault((scenario, mode), []).append(run_scenario(served.url, scenario, args))
                        time.sleep(0.5)  # let the server see the previous scenario's connections close

    def ms(values: list[float]) -> str:
        return f"{1000 * statistics.median(values):.1f}" if values else "-"

    print(
        f"\nAfter {args.seconds:g} s; limits: header_timeout_s {args.header_timeout:g}, "
        f"body_idle_timeout_s {args.body_idle_timeout:g}, max_header_bytes 64KiB, max_headers 128, "
        f"max_connections 1024; off: all null. Medians across {args.rounds} round(s).\n"
    )
    header = f"| {'scenario':<40} | {'mode':<6} | still open | /healthz p50 ms | /healthz max ms | probes failed |"
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for scenario in scenarios:
        for mode in ("limits", "off"):
            runs = outcomes[(scenario, mode)]
            still_open = statistics.median(run.still_open for run in runs)
            p50 = ms([statistics.median(run.probe_latencies) for run in runs if run.probe_latencies])
            worst = ms([max(run.probe_latencies) for run in runs if run.probe_latencies])
            failed = statistics.median(run.probe_failures for run in runs)
            print(
                f"| {labels[scenario]:<40} | {mode:<6} | {still_open:>10g} | {p50:>15} | {worst:>15} | {failed:>13g} |"
            )


if __name__ == "__main__":
    main()
