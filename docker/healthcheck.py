"""Container HEALTHCHECK: GET http://127.0.0.1:<port><path>; exit 0 on a 2xx answer, 1 otherwise.

The port is the one the process listens on: `<env-prefix>SERVER__PORT` when set (the environment beats the YAML:
`MMGATE_` for the gateway, `MMGATE_ENGINE_` for the engine), else `server.port` from the mounted YAML file, else
the default port. Only the standard library and PyYAML (a base dependency) are imported, so a probe every few
seconds stays cheap.

    python /opt/mmgate/healthcheck.py --config FILE --env-prefix MMGATE_ --default-port 8000 [--path /healthz]
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.request
from collections.abc import Mapping

import yaml


def listen_port(config_file: str, env_prefix: str, default: int, environ: Mapping[str, str] = os.environ) -> int:
    from_env = environ.get(f"{env_prefix}SERVER__PORT")
    if from_env:
        return int(from_env)
    try:
        with open(config_file, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError:
        return default
    server = data.get("server") if isinstance(data, dict) else None
    port = server.get("port") if isinstance(server, dict) else None
    return int(port) if port is not None else default


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--env-prefix", required=True)
    parser.add_argument("--default-port", type=int, required=True)
    parser.add_argument("--path", default="/healthz")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    url = f"http://127.0.0.1:{listen_port(args.config, args.env_prefix, args.default_port)}{args.path}"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            return 0 if 200 <= response.status < 300 else 1
    except OSError as exc:  # URLError and HTTPError (a 5xx answer) are OSErrors
        print(f"healthcheck {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
