"""The registry behind the gateway's series: what a scrape leaves out, and how the series of
several worker processes are read as one (prometheus_client's multiprocess files)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


class Registry(CollectorRegistry):
    """Leaves out the `*_created` series, which double what a scrape stores and nothing reads."""

    def collect(self) -> Iterable[Metric]:
        for family in super().collect():
            if family.type in ("counter", "histogram"):
                family.samples = [
                    sample for sample in family.samples if not sample.name.endswith("_created")
                ]
            yield family


class AllWorkers(Collector):
    """Every worker's series from the multiprocess files, under this process's help texts,
    followed by the families only this process knows (custom collectors, unused label sets)."""

    def __init__(self, local: CollectorRegistry, directory: str) -> None:
        self._local = local
        self._directory = directory

    def collect(self) -> Iterable[Metric]:
        local = {family.name: family for family in self._local.collect()}
        every_worker = MultiProcessCollector(None, self._directory)  # type: ignore[no-untyped-call]
        for family in every_worker.collect():  # type: ignore[no-untyped-call]
            own = local.pop(family.name, None)
            if own is not None:
                family.documentation = own.documentation
            yield family
        yield from local.values()


def worker_restarts_counter(registry: CollectorRegistry | None) -> Counter:
    """Counted by the supervising process; declared by every worker too, for its help text."""
    return Counter(
        "gateway_worker_restarts",
        "Worker processes that died and were started again by the supervising process.",
        registry=registry,
    )


def render(registry: CollectorRegistry, multiprocess_dir: str | None) -> bytes:
    """The text exposition of `registry`, or of every worker's series under `--workers`."""
    if multiprocess_dir is None:
        return generate_latest(registry)
    return generate_latest(AllWorkers(registry, multiprocess_dir))
