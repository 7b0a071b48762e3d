"""The gateway's own process series (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
`process_open_fds`, ...), as prometheus_client's process collector reads them from /proc.

One process exports the collector as it is, read at each scrape. Under `--workers` a scrape is
answered by one worker, so each process (workers and supervisor) copies its own values into
multiprocess series every second instead, and a scrape reports the pod: CPU seconds summed over
every process that ever ran, memory and open files summed over the live ones, the earliest
start time (docs/metrics.md).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector

# The collector's gauges and how the workers' values combine into the pod's.
_GAUGE_MODES = {
    "process_resident_memory_bytes": "livesum",
    "process_virtual_memory_bytes": "livesum",
    "process_open_fds": "livesum",
    "process_max_fds": "livemin",
    "process_start_time_seconds": "min",
}
_CPU = "process_cpu_seconds"


class ProcessSeries:
    def __init__(self, registry: CollectorRegistry, multiprocess: bool) -> None:
        if not multiprocess:
            ProcessCollector(registry=registry)
            self._source: ProcessCollector | None = None
            return
        self._source = ProcessCollector(registry=None)
        self._gauges: dict[str, Gauge] = {}
        self._cpu: Counter | None = None
        self._cpu_counted = 0.0
        for family in self._source.collect():
            if family.name == _CPU:
                self._cpu = Counter(family.name, family.documentation, registry=registry)
            elif family.name in _GAUGE_MODES:
                self._gauges[family.name] = Gauge(
                    family.name,
                    family.documentation,
                    multiprocess_mode=_GAUGE_MODES[family.name],  # type: ignore[arg-type]
                    registry=registry,
                )

    def refresh(self) -> None:
        """Copy this process's values into the multiprocess series (nothing to do otherwise:
        the collector reads them at the scrape)."""
        if self._source is None:
            return
        for family in self._source.collect():
            if not family.samples:
                continue
            value = family.samples[0].value
            gauge = self._gauges.get(family.name)
            if gauge is not None:
                gauge.set(value)
            elif family.name == _CPU and self._cpu is not None and value > self._cpu_counted:
                self._cpu.inc(value - self._cpu_counted)
                self._cpu_counted = value
