"""Replica health: when a replica is ejected from routing and when it is let back in.

Two kinds of evidence, one verdict per replica (`Backend.healthy`):

- Active probes (`GET /health`, by `BackendMonitor`). A replica that has never passed a probe
  is *starting*: its first passed probe admits it. A serving replica is ejected after
  `unhealthy_threshold` consecutive failed probes; an ejected one is readmitted after
  `healthy_threshold` consecutive passed probes.
- Passive observation of real requests. A refused or unreachable connection ejects the replica
  at once (nothing is listening: trying it again only costs the next request a connect);
  other failures (5xx answers, timeouts, responses that break off) eject it after
  `failure_threshold` in a row. Any good answer resets that count.

Whatever ejected a replica, only probes readmit it, so a replica that fails requests while its
`/health` still answers is tried again after `healthy_threshold` probe intervals.
"""

from __future__ import annotations

import logging

from gateway.backends.pool import Backend, BackendPool

log = logging.getLogger("gateway.backends.health")

CONNECT = "connect"
"""The failure cause of a connection that could not be opened."""


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
        if passed:
            backend.probe_streak = max(backend.probe_streak, 0) + 1
            if backend.healthy:
                return
            if not backend.ejected or backend.probe_streak >= self._healthy_threshold:
                backend.ejected = False
                backend.failures = 0
                self._pool.set_health(backend, True)
            return
        backend.probe_streak = min(backend.probe_streak, 0) - 1
        if backend.healthy and -backend.probe_streak >= self._unhealthy_threshold:
            self._eject(backend, f"{-backend.probe_streak} failed probes")

    def request_succeeded(self, backend: Backend) -> None:
        """A replica answered (with anything but a 5xx): its run of failures is over."""
        if backend.failures:
            backend.failures = 0

    def request_failed(self, backend: Backend, cause: str) -> None:
        """Record a request that failed at `backend` for `cause` (a metric cause label)."""
        backend.failures += 1
        if not backend.healthy:
            return
        if cause == CONNECT:
            self._eject(backend, "connection refused or unreachable")
        elif backend.failures >= self._failure_threshold:
            self._eject(backend, f"{backend.failures} failed requests in a row ({cause})")

    def _eject(self, backend: Backend, why: str) -> None:
        backend.ejected = True
        backend.probe_streak = 0
        if self._pool.set_health(backend, False):
            log.info("backend %s ejected: %s", backend.name, why)
