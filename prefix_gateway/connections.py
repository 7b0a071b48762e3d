"""How many client connections the server may hold: in all, within the open-file limit
(`--max-connections`), and per peer address, so that one address cannot take them all
(`--max-connections-per-client`)."""

from __future__ import annotations

import logging
import resource
from collections import Counter

from prefix_gateway.config import Settings

log = logging.getLogger("prefix_gateway.server")


class ClientConnections:
    """Open connections per peer address; `cap` 0 counts nothing."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: Counter[str] = Counter()

    def admit(self, peer: str) -> bool:
        """Count a new connection from `peer`, unless `peer` already has `cap` open."""
        if not self.cap:
            return True
        if self._open[peer] >= self.cap:
            return False
        self._open[peer] += 1
        return True

    def release(self, peer: str) -> None:
        """A connection `admit` counted has closed."""
        if not self.cap:
            return
        left = self._open[peer] - 1
        if left > 0:
            self._open[peer] = left
        else:
            del self._open[peer]

    def open_from(self, peer: str) -> int:
        return self._open[peer]


_FILES_RESERVE = 256
"""Open files kept for everything but connections: listeners, logs, probes, discovery."""


def connection_cap(settings: Settings) -> int:
    """`--max-connections`, within the open-file limit (raised towards its hard limit) less
    what upstream and Redis connections need: without those, replicas would look down."""
    others = settings.max_concurrency + settings.redis_max_connections + _FILES_RESERVE
    needed = settings.max_connections + others
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft != resource.RLIM_INFINITY and soft < needed:
        cap = max(16, soft - others)
        log.warning(
            "the open-file limit (%d) leaves room for %d client connections, not the %d of"
            " --max-connections; raise `ulimit -n`",
            soft,
            cap,
            settings.max_connections,
        )
        return cap
    return settings.max_connections
