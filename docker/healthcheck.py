"""Container HEALTHCHECK: GET http://127.0.0.1:<port><path>; exit 0 on a 2xx answer, 1 otherwise.

The port is the one the process listens on: `<env-prefix>SERVER__PORT` when set (the environment beats the YAML:
`MMGATE_` for the gateway, `MMGATE_ENGINE_` for the engine), else `server.port` from the mounted YAML file, else
the default port. `/healthz` is probed on `server.metrics_port` instead when that is set (found the same way): the
gateway's metrics listener serves `/healthz` too, and a client holding every connection the main port allows
(`server.max_connections`, answered 503 past it) must not fail the probe of a process that is alive. Only the
standard library and PyYAML (a base dependency) are imported, so a probe every few seconds stays cheap.

    python /opt/mmgate/healthcheck.py --config FILE --env-prefix MMGATE_ --default-port 8000 [--path /healthz]
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.request
from collections.abc import Mapping

import yaml


def server_key(config_file: str, env_prefix: str, key: str, environ: Mapping[str, str] = os.environ) -> int | None:
    """`server.<key>` as a port number: from `<env-prefix>SERVER__<KEY>`, else the YAML file; None when neither
    sets it (or sets it to null)."""
    from_env = environ.get(f"{env_prefix}SERVER__{key.upper()}")
    if from_env:
        return None if from_env.strip().lower() in ("null", "none", "~") else int(from_env)
    try:
        with open(config_file, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError:
        return None
    server = data.get("server") if isinstance(data, dict) else None
    value = server.get(key) if isinstance(server, dict) else None
    return int(value) if value is not None else None


def listen_port(config_file: str, env_prefix: str, default: int, environ: Mapping[str, str] = os.environ) -> int:
    port = server_key(config_file, env_prefix, "port", environ)
    return port if port is not None else default


def probe_port(
    config_file: str, env_prefix: str, default: int, path: str, environ: Mapping[str, str] = os.environ
) -> int:
    """The port to probe `path` on: the metrics listener's for `/healthz` when there is one, else the main one."""
    if path == "/healthz":
        metrics_port = server_key(config_file, env_prefix, "metrics_port", environ)
        if metrics_port is not None:
            return metrics_port
    return listen_port(config_file, env_prefix, default, environ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--env-prefix", required=True)
    parser.add_argument("--default-port", type=int, required=True)
    parser.add_argument("--path", default="/healthz")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    url = f"http://127.0.0.1:{probe_port(args.config, args.env_prefix, args.default_port, args.path)}{args.path}"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            return 0 if 200 <= response.status < 300 else 1
    except OSError as exc:  # URLError and HTTPError (a 5xx answer) are OSErrors
        print(f"healthcheck {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
