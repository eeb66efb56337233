"""The service's own Prometheus metrics, read from the database at each scrape.

They live in a ``CollectorRegistry`` of the app's, not in prometheus_client's global
one: a process may hold several apps (the tests make many), each with its own database.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from sqlalchemy import Engine
from starlette.datastructures import State

from service.control.queue import Scheduler
from service.core.status import RunStatus
from service.storage import store, workers


class ServiceCollector:
    """Runs and workers by status, fill parameter pulls and the scheduler's liveness."""

    def __init__(self, engine: Engine, scheduler: Scheduler) -> None:
        self.engine = engine
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        """The metrics as they stand now (called by the registry at every scrape)."""
        runs = store.run_counts(self.engine)
        by_status = workers.worker_counts(self.engine)
        pulls = store.connector_pulls(self.engine)
        by_run = GaugeMetricFamily("decodebench_runs", "Runs by status.", labels=["status"])
        # Every status, 0 included: a series that vanishes reads as "no data", not 0.
        for status in RunStatus:
            by_run.add_metric([status.value], runs.get(status.value, 0))
        yield by_run
        by_worker = GaugeMetricFamily(
            "decodebench_workers", "Workers by status.", labels=["status"]
        )
        for name, count in sorted(by_status.items()):
            by_worker.add_metric([name], count)
        yield by_worker
        yield CounterMetricFamily(
            "decodebench_connector_pulls",
            "Fill parameter pulls served to connectors.",
            value=pulls,
        )
        yield GaugeMetricFamily(
            "decodebench_scheduler_up",
            "1 while the scheduler loop runs.",
            value=int(self.scheduler.alive()),
        )


def make_registry(engine: Engine, scheduler: Scheduler) -> CollectorRegistry:
    """A registry holding the service's metrics for one app."""
    registry = CollectorRegistry()
    registry.register(ServiceCollector(engine, scheduler))
    return registry


def app_registry(state: State, engine: Engine, scheduler: Scheduler) -> CollectorRegistry:
    """The app's registry, made at its first scrape and kept on its ``state``."""
    registry: CollectorRegistry | None = getattr(state, "prometheus", None)
    if registry is None:
        # Two first scrapes at once may each make one: both read the same database.
        registry = state.prometheus = make_registry(engine, scheduler)
    return registry
