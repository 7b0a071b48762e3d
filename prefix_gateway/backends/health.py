"""Replica health: ejection after failed probes or requests (a refused connection at once),
readmission by probes only (docs/reliability.md).
"""

from __future__ import annotations

import logging

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool

log = logging.getLogger("prefix_gateway.backends.health")

CONNECT = "connect"  # the failure cause of a connection that could not be opened


class Health:
    def __init__(
        self,
        pool: BackendPool,
        unhealthy_threshold: int,
        healthy_threshold: int,
        failure_threshold: int,
    ) -> None:
        self._pool = pool
        self._unhealthy_threshold = unhealthy_threshold
        self._healthy_threshold = healthy_threshold
        self._failure_threshold = failure_threshold

    def probed(self, backend: Backend, passed: bool) -> None:
        """Record one active probe's result."""
        if backend.stalled:
            return  # `/health` says nothing of a stalled engine: `inference_probed` decides
        if passed:
            passes = backend.probe_passed()
            if backend.healthy:
                return
            if not backend.ejected or passes >= self._healthy_threshold:
                backend.readmit()
                self._pool.set_health(backend, True)
            return
        failed = backend.probe_failed()
        if backend.healthy and failed >= self._unhealthy_threshold:
            self._eject(backend, f"{failed} failed probes")

    def request_succeeded(self, backend: Backend) -> None:
        """A replica answered (with anything but a 5xx): its run of failures is over."""
        backend.request_succeeded()

    def request_failed(self, backend: Backend, cause: str) -> None:
        """Record a request that failed at `backend` for `cause` (a metric cause label)."""
        failures = backend.request_failed()
        if not backend.healthy:
            return
        if cause == CONNECT:
            self._eject(backend, "connection refused or unreachable")
        elif failures >= self._failure_threshold:
            self._eject(backend, f"{failures} failed requests in a row ({cause})")

    def stalled(self, backend: Backend, why: str) -> None:
        """It answers probes but produces nothing: out until an inference probe passes."""
        backend.stall()
        log.warning("backend %s stalled: %s", backend.name, why)
        self._eject(backend, f"stalled: {why}")

    def inference_probed(self, backend: Backend, passed: bool) -> None:
        """Record a one-token completion asked of a stalled backend."""
        if passed and backend.stalled:
            backend.readmit()
            log.warning("backend %s answers inference again: readmitted", backend.name)
            self._pool.set_health(backend, True)

    def _eject(self, backend: Backend, why: str) -> None:
        backend.eject(why)
        if self._pool.set_health(backend, False):
            log.info("backend %s ejected: %s", backend.name, why)
