"""What the media budget reports: the metrics it copies and its `/readyz` line."""

from __future__ import annotations

from gateway.budget.factory import build_budget
from gateway.budget.redis import RedisBudget
from gateway.budget.reporter import BudgetReporter
from gateway.metrics import GatewayMetrics
from tests.gateway.budget.test_factory import GIB, gauge, settings
from tests.redis_server import RedisServer


async def test_reporter_copies_the_redis_counters_and_the_cluster_view(redis_server: RedisServer) -> None:
    config = settings(
        limits={"budget_backend": "redis", "max_multimodal_cpu_bytes": 4 * GIB},
        redis={"url": redis_server.url, "key_prefix": "reporter-test"},
    )
    metrics = GatewayMetrics(shared_budget=True)
    budget = build_budget(config, metrics)
    reporter = BudgetReporter(budget, metrics)
    await reporter.start()
    try:
        reservation = await budget.reserve(GIB)
        await budget.refresh()
        reporter.sync()
        assert gauge(metrics, "mmgate_budget_cluster_in_use_bytes") == GIB
        assert gauge(metrics, "mmgate_budget_cluster_capacity_bytes") == 4 * GIB
        assert gauge(metrics, "mmgate_budget_backend_seconds_count") >= 2  # ping, snapshot, reserve ...
        ok, line, where = await reporter.readiness()
        assert ok
        assert line.startswith(f"redis ok, {GIB:,} of")
        assert where == f"redis {redis_server.url}"
        reservation.release()
        assert isinstance(budget, RedisBudget)
        budget.stats.lease_renewals += 3  # as a heartbeat would count them
        budget.stats.backend_errors += 2
        reporter.sync()
        reporter.sync()  # copies each increase once
        assert gauge(metrics, "mmgate_budget_lease_renewals_total") == 3
        assert gauge(metrics, "mmgate_budget_backend_errors_total") == 2
    finally:
        await reporter.aclose()


async def test_local_readiness_reports_the_budget() -> None:
    metrics = GatewayMetrics()
    reporter = BudgetReporter(build_budget(settings(), metrics), metrics)
    assert await reporter.readiness() == (True, "local 2GiB: 0 bytes in use, 0 waiting", None)
    assert gauge(metrics, "mmgate_budget_cluster_capacity_bytes") == 2 * GIB
