"""Serves the Prometheus endpoint of a process that listens on localhost only on a port Prometheus reaches.

    python metrics-relay.py --port 9101 --target http://127.0.0.1:8100/metrics

`GET /metrics` (and `HEAD`) answers what `GET <target>` answers: its status, content type and body; 502 when the
target does not answer. Every other path is 404 and every other method 501, so nothing but the metrics is reachable
through the relay. The standard library only: it runs on any image with Python 3.
"""

from __future__ import annotations

import argparse
import signal
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATH = "/metrics"


def relay_handler(target: str, timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Relay(BaseHTTPRequestHandler):
        server_version = "mmgate-metrics-relay"

        def do_GET(self) -> None:
            self._relay(with_body=True)

        def do_HEAD(self) -> None:
            self._relay(with_body=False)

        def _relay(self, *, with_body: bool) -> None:
            if self.path.partition("?")[0] != PATH:
                self._answer(404, "text/plain; charset=utf-8", b"not found: only GET /metrics is relayed\n", with_body)
                return
            try:
                with urllib.request.urlopen(target, timeout=timeout_s) as response:
                    status, payload = response.status, response.read()
                    content_type = response.headers.get("Content-Type", "text/plain")
            except urllib.error.HTTPError as error:
                status, payload = error.code, error.read()
                content_type = error.headers.get("Content-Type", "text/plain")
            except OSError as error:
                status, payload = 502, f"{target} did not answer: {error}\n".encode()
                content_type = "text/plain; charset=utf-8"
            self._answer(status, content_type, payload, with_body)

        def _answer(self, status: int, content_type: str, payload: bytes, with_body: bool) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if with_body:
                self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per scrape would only be noise

    return Relay


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default: every interface)")
    parser.add_argument("--port", type=int, required=True, help="listen port")
    parser.add_argument("--target", required=True, help="the URL relayed, e.g. http://127.0.0.1:8100/metrics")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="longest wait for the target (default 10)")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), relay_handler(args.target, args.timeout_s))
    # As a container's PID 1 the process ignores SIGTERM unless it handles it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with server:
        server.serve_forever()


if __name__ == "__main__":
    main()
