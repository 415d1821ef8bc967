"""Refusal rounds: what a gateway process holds after each round of concurrent requests that all end the same way.

    .venv/bin/python tests/bench/bench_refusals.py [--rounds 6] [--clients 12] [--mib 20] [--baseline TREE]

For each kind (a 400 for invalid base64, a 400 for malformed JSON after a long string, a 400 for a truncated
3000x2000 JPEG, a 502 for an upstream that is down, a 413 for a body over the cap; 12 bodies of a 40 MiB image, and
3 bodies of `{},{},...`, each with 128 MiB for bodies), a fresh gateway process with the limits of its kind gets
`--rounds` rounds of `--clients` concurrent requests of about `--mib` MiB each; its RSS is read after each round
(once its heap trim had a second to run) and its peak (VmHWM) at the end. `--baseline TREE` runs the same against
the gateway of another checkout (e.g. `git worktree add /tmp/base <commit>`), side by side.
`--collector off` starts the gateways with the cyclic garbage collector disabled: what a cycle holds then stays.

Loopback only; the upstream is `tests/gateway/stub_upstream.py` in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.gateway.media_factory import chat_body, image_bytes  # noqa: E402
from tests.gateway.stub_upstream import StubUpstream  # noqa: E402
from tests.observe import process_memory  # noqa: E402
from tests.servers import ServerThread, free_port, served_process  # noqa: E402

MIB = 1 << 20
CHAT = "/v1/chat/completions"


def invalid_base64(mib: int) -> bytes:
    return chat_body("data:image/png;base64," + "!" * (mib * MIB))


def malformed_json(mib: int) -> bytes:
    return b'{"model":"m","messages":[{"role":"user","content":"' + b"a" * (mib * MIB) + b'"}'


def truncated_jpeg(mib: int) -> bytes:
    jpeg = image_bytes(3000, 2000)
    return chat_body("data:image/jpeg;base64," + base64.b64encode(jpeg[: len(jpeg) * 3 // 4]).decode())


def text(mib: int) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * (mib * MIB)}]})


def over_cap(mib: int) -> bytes:
    return invalid_base64(70)  # over the default 64 MiB body cap


def empty_objects(mib: int) -> bytes:
    """A text-only body of `{},{},...`: about 24 times its size once parsed."""
    return b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":[' + b"{}," * (mib * MIB // 3) + b"{}]}"


BODY_BOUND = {"max_buffered_body_bytes": "128MiB"}


@dataclass(frozen=True)
class Kind:
    body: Callable[[int], bytes]
    upstream_down: bool = False
    limits: dict[str, object] = field(default_factory=dict)
    clients: int | None = None  # None: --clients


KINDS: dict[str, Kind] = {
    "400 invalid base64": Kind(invalid_base64),
    "400 malformed JSON": Kind(malformed_json),
    "400 truncated JPEG": Kind(truncated_jpeg),
    "502 upstream down": Kind(text, upstream_down=True),
    "413 body over cap": Kind(over_cap),
    # The peaks the issue names: 12 image bodies of 40 MiB, and three bodies that parse into gigabytes, each with
    # 128 MiB for bodies.
    "40 MiB images, 128 MiB for bodies": Kind(lambda mib: invalid_base64(40), limits=BODY_BOUND),
    "3 x {},{},..., 128 MiB for bodies": Kind(empty_objects, limits=BODY_BOUND, clients=3),
}


def command(tree: Path, collector: str) -> list[str]:
    """`python -m gateway` of `tree`'s code (ahead of the installed one), the collector on or off."""
    disable = "gc.disable(); " if collector == "off" else ""
    code = (
        f"import gc, runpy, sys; sys.path.insert(0, {str(tree)!r}); {disable}"
        "runpy.run_module('gateway', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code]


async def one_round(url: str, body: bytes, clients: int) -> Counter[int]:
    """The statuses of `clients` requests sent at once; 0 for a connection closed before an answer was read (a
    refusal sent while the body still went out)."""

    async def one(client: httpx.AsyncClient) -> int:
        try:
            return (await client.post(url + CHAT, content=body)).status_code
        except httpx.TransportError:
            return 0

    async with httpx.AsyncClient(timeout=120) as client:
        return Counter(await asyncio.gather(*(one(client) for _ in range(clients))))


def run_kind(
    tree: Path, kind: str, upstream_url: str, args: argparse.Namespace, directory: Path
) -> tuple[list[int], int, Counter[int]]:
    chosen = KINDS[kind]
    config = {
        "upstream": {"url": f"http://127.0.0.1:{free_port()}" if chosen.upstream_down else upstream_url},
        "server": {"access_log": False, "log_level": "warning"},
        "limits": chosen.limits,
    }
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    body = chosen.body(args.mib)
    clients = chosen.clients or args.clients
    statuses: Counter[int] = Counter()
    with served_process("gateway", path, command=command(tree, args.collector)) as served:
        pid = served.process.pid
        start = process_memory(pid)
        after: list[int] = []
        for _ in range(args.rounds):
            statuses += asyncio.run(one_round(served.url, body, clients))
            time.sleep(1.2)  # the heap trim runs once a second
            after.append(process_memory(pid) - start)
        peak = process_memory(pid, "VmHWM") - start
    return after, peak, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--mib", type=int, default=20)
    parser.add_argument("--baseline", type=Path, help="another checkout whose gateway runs first, side by side")
    parser.add_argument("--collector", choices=["on", "off"], default="on")
    parser.add_argument("--only", nargs="*", choices=list(KINDS), default=list(KINDS))
    args = parser.parse_args()
    trees = ([("baseline", args.baseline.resolve())] if args.baseline else []) + [("this tree", ROOT)]
    stub = StubUpstream()
    print(f"{args.rounds} rounds of {args.clients} concurrent ~{args.mib} MiB requests; collector {args.collector}")
    print("| kind | gateway | statuses | RSS growth after each round (MiB) | peak growth (MiB) |")
    print("| --- | --- | --- | --- | ---: |")
    with ServerThread(stub) as upstream, tempfile.TemporaryDirectory() as scratch:
        for kind in args.only:
            for name, tree in trees:
                after, peak, statuses = run_kind(tree, kind, upstream.url, args, Path(scratch))
                rounds = ", ".join(f"{value / MIB:+.0f}" for value in after)
                answered = ", ".join(f"{count} x {status}" for status, count in sorted(statuses.items()))
                print(f"| {kind} | {name} | {answered} | {rounds} | {peak / MIB:+.0f} |", flush=True)


if __name__ == "__main__":
    main()
