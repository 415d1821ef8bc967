"""A real Prometheus on loopback, scraping two real gateways that share one real redis-server's media budget, run to
saturation: the state of MmgateMediaBudgetSaturated and the value of the dashboard's "Budget utilization" panel, with
the rule and the panel as they are and as they were at a base revision (evaluated by the same Prometheus on the same
series).

    .venv/bin/python tests/bench/bench_prometheus_budget.py [--base REV] [--seconds 40]

The gateways run in proxy mode in front of a stub model server that holds every request. Each request carries one
256x256 image, charged its decoded pixels alone (262,144 bytes); the shared cap is 11.96 of them. The first gateway
gets 6 requests, then the second 5: the budget is 92% reserved, each gateway holding about half of that, and the
12th does not fit. Then each gets more, to 24 requests each, which wait (the admission timeout is long).
Prometheus scrapes every second and evaluates configs/alerts.yml every second, its `for:` shortened to 10 s (the
only change) so that the run takes seconds, not 10 minutes. Needs Debian's prometheus and redis-server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx
import yaml

from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import wait_until
from tests.redis_server import RedisServer
from tests.servers import ROOT, ServerThread, free_port, served_process

CHARGE = 256 * 256 * 4  # one request's charge: the decoded pixels of its image
CAP = int(11.96 * CHARGE)
OFFERED = 24
MEDIA = chat_body(data_url(image_bytes(256, 256)))


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        answer = json.load(response)
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


def panel_exprs(dashboard: dict[str, Any], title: str) -> list[str]:
    panels = [p for p in dashboard["panels"] if p.get("title") == title]
    exprs = [target["expr"] for target in panels[0]["targets"]]
    return [e.replace("$__rate_interval", "1m").replace("$instance", ".+") for e in exprs]


def saturation_rule(alerts: dict[str, Any]) -> str:
    (rule,) = [r for g in alerts["groups"] for r in g["rules"] if r.get("alert") == "MmgateMediaBudgetSaturated"]
    return str(rule["expr"])


def show(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no series)"
    return ", ".join(
        f"{ {k: v for k, v in row['metric'].items() if k != '__name__'} } = {float(row['value'][1]):.2f}"
        for row in rows
    )


def at_revision(revision: str, path: str) -> str:
    command = ["git", "show", f"{revision}:{path}"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default=None, help="a revision whose alert rule and panel to evaluate beside")
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()
    binary = shutil.which("prometheus")
    if binary is None:
        sys.exit("prometheus is not installed (Debian: apt-get install prometheus)")
    alerts = yaml.safe_load((ROOT / "configs" / "alerts.yml").read_text())
    for group in alerts["groups"]:
        for rule in group["rules"]:
            rule["for"] = "10s"
    dashboard = json.loads((ROOT / "configs" / "grafana" / "mmgate.json").read_text())
    base_rule = base_panel = None
    if args.base:
        base_rule = saturation_rule(yaml.safe_load(at_revision(args.base, "configs/alerts.yml")))
        base_dashboard = json.loads(at_revision(args.base, "configs/grafana/mmgate.json"))
        base_panel = panel_exprs(base_dashboard, "Budget utilization")
    stub = StubUpstream()
    stub.state.gated = True
    with tempfile.TemporaryDirectory() as tmp_name, ServerThread(stub) as upstream, ExitStack() as stack:
        tmp = Path(tmp_name)
        redis = RedisServer(tmp)
        redis.start()
        stack.callback(redis.stop)
        metrics_ports = [free_port(), free_port()]
        served = []
        for index, metrics_port in enumerate(metrics_ports):
            config = tmp / f"gateway-{index}.yaml"
            settings = {
                "server": {"access_log": False, "metrics_port": metrics_port, "log_level": "warning"},
                "upstream": {"url": upstream.url},
                "media": {"processor": None},
                "limits": {
                    "budget_backend": "redis",
                    "max_multimodal_cpu_bytes": CAP,
                    "max_multimodal_cpu_bytes_per_request": CHARGE,
                    "max_buffered_body_bytes": 256 << 20,
                    "charge_raw_body": False,
                    "admission_timeout_s": 600,
                },
                "redis": {"url": redis.url},
            }
            config.write_text(yaml.safe_dump(settings))
            env = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
            log = tmp / f"gateway-{index}.log"
            served.append(stack.enter_context(served_process("gateway", config, env=env, log=log)))
        (tmp / "alerts.yml").write_text(yaml.safe_dump(alerts))
        prometheus_config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp / "alerts.yml")],
            "scrape_configs": [
                {
                    "job_name": "mmgate-gateway",
                    "static_configs": [{"targets": [f"127.0.0.1:{port}" for port in metrics_ports]}],
                }
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config))
        port = free_port()
        prometheus = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp / "prometheus.log").open("w"),
        )
        url = f"http://127.0.0.1:{port}"
        try:
            with ThreadPoolExecutor(len(served) * OFFERED) as pool:
                post = lambda gateway: pool.submit(  # noqa: E731
                    httpx.post, gateway.url + "/v1/chat/completions", content=MEDIA, timeout=900
                )
                first, second = served
                futures = [post(first) for _ in range(6)]
                wait_until(lambda: stub.state.at_gate == 6, 30, "the first gateway's 6 requests admitted")
                futures += [post(second) for _ in range(5)]
                wait_until(lambda: stub.state.at_gate == 11, 30, "the second gateway's 5 requests admitted")
                futures += [post(first) for _ in range(OFFERED - 6)] + [post(second) for _ in range(OFFERED - 5)]
                deadline = time.monotonic() + args.seconds
                while time.monotonic() < deadline:
                    time.sleep(1)
                state = query(url, 'ALERTS{alertname="MmgateMediaBudgetSaturated"}')
                process = query(url, "mmgate_budget_in_use_bytes / mmgate_budget_capacity_bytes")
                panel = [show(query(url, expr)) for expr in panel_exprs(dashboard, "Budget utilization")]
                print(f"gated model server holds {stub.state.at_gate} requests; {len(served)} gateways x {OFFERED}")
                print(f"each process's part of the cap: {show(process)}")
                waiting = query(url, 'max by (budget) (mmgate_budget_cluster_waiting_requests{budget!=""})')
                print(f"waiting for the shared budget: {show(waiting)}")
                print(f"MmgateMediaBudgetSaturated now: {show(state)}")
                print(f"'Budget utilization' now: local {panel[0]}; shared {panel[1]}")
                if base_rule is not None and base_panel is not None:
                    fired = show(query(url, base_rule))
                    print(f"{args.base}'s rule expression now: {fired} (no series: it would not fire)")
                    print(f"{args.base}'s panel now: {show(query(url, base_panel[0]))}")
                stub.state.open_gate(len(futures))
                statuses = [future.result().status_code for future in futures]
                print(f"answers: {statuses.count(200)} x 200, {len(statuses) - statuses.count(200)} other")
        finally:
            prometheus.terminate()
            prometheus.wait(10)


if __name__ == "__main__":
    main()
