"""The doctor's checks inside `serve`: each replica examined once it is healthy (when it joins,
and again whenever it comes back), then every `--doctor-interval` seconds; one at a time, so a
fleet's engines are never probed all at once. Results go to `gateway_backend_check` and to
`/admin/backends`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.doctor.examination import Doctor
from prefix_gateway.doctor.verdicts import CheckResult, Status
from prefix_gateway.metrics import Metrics

log = logging.getLogger("prefix_gateway.doctor")

_TICK_SECONDS = 1.0


@dataclass(frozen=True)
class Examination:
    at: float
    """`time.time()` when it ended."""
    results: list[CheckResult]


class DoctorWatch:
    def __init__(
        self, pool: BackendPool, doctor: Doctor, metrics: Metrics, interval: float
    ) -> None:
        self._pool = pool
        self._doctor = doctor
        self._metrics = metrics
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self._due: dict[str, float] = {}
        """When each healthy backend is examined next, on the loop's clock."""
        self.examinations: dict[str, Examination] = {}

    def start(self) -> None:
        if self._interval > 0:
            self._task = asyncio.create_task(self._run(), name="doctor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def forget(self, name: str) -> None:
        """`name` left the pool (its series leave with `Metrics.forget_backend`)."""
        self._due.pop(name, None)
        self.examinations.pop(name, None)

    async def _run(self) -> None:
        while True:
            try:
                await self._examine_due()
            except Exception:  # a failed round must never end the checks
                log.exception("the doctor's checks failed")
            await asyncio.sleep(_TICK_SECONDS)

    async def _examine_due(self) -> None:
        loop = asyncio.get_running_loop()
        for backend in list(self._pool.backends):
            if not backend.healthy or backend.draining:
                self._due.pop(backend.name, None)  # examined again once it is back
                continue
            if loop.time() < self._due.get(backend.name, 0.0):
                continue
            results = await self._doctor.examine(backend)
            if self._pool.get(backend.name) is not backend:
                continue  # it left meanwhile
            self._due[backend.name] = loop.time() + self._interval
            self._record(backend.name, results)

    def _record(self, name: str, results: list[CheckResult]) -> None:
        previous = self.examinations.get(name)
        self.examinations[name] = Examination(time.time(), results)
        gauge = self._metrics.backend_check
        for result in results:
            check = result.check.value
            if result.status is Status.SKIP:
                with contextlib.suppress(KeyError):
                    gauge.remove(name, check)
                continue
            gauge.labels(name, check).set(1 if result.passed else 0)
        was_failing = (
            {r.check for r in previous.results if r.status is Status.FAIL} if previous else set()
        )
        for result in results:
            if result.status is Status.FAIL and result.check not in was_failing:
                log.warning("backend %s fails %s: %s", name, result.check.value, result.detail)
