"""Container HEALTHCHECK: GET http://127.0.0.1:<port><path>, exit 0 on a 2xx answer, 1 otherwise.

The port is the one the process listens on: `MMGATE_SERVER__PORT` when set (the environment beats the YAML),
else `server.port` from the mounted YAML file, else the default given on the command line. Only the standard
library and PyYAML (a base dependency) are imported, so a probe every few seconds stays cheap.

    python /opt/mmgate/healthcheck.py CONFIG_FILE DEFAULT_PORT [PATH]
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

import yaml


def listen_port(config_file: str, default: int) -> int:
    from_env = os.environ.get("MMGATE_SERVER__PORT")
    if from_env:
        return int(from_env)
    try:
        with open(config_file, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except OSError:
        return default
    server = data.get("server") if isinstance(data, dict) else None
    port = server.get("port") if isinstance(server, dict) else None
    return int(port) if port is not None else default


def main(argv: list[str]) -> int:
    config_file, default_port = argv[1], int(argv[2])
    path = argv[3] if len(argv) > 3 else "/healthz"
    url = f"http://127.0.0.1:{listen_port(config_file, default_port)}{path}"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return 0 if 200 <= response.status < 300 else 1
    except (OSError, urllib.error.URLError) as exc:
        print(f"healthcheck {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
