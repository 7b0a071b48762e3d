"""Serving the emulated replica with uvicorn."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import uvicorn

from prefix_gateway.emulator.app import build_app
from prefix_gateway.emulator.config import EmulatorConfig

# In-flight requests get this long to finish after SIGTERM; then they are aborted.
GRACEFUL_SHUTDOWN_SECONDS = 5


PARENT_VARIABLE = "PREFIX_GATEWAY_PARENT_PID"
"""Set by whoever starts a replica as its child: the replica then ends with that process."""


def serve(config: EmulatorConfig) -> None:
    """Serve until SIGTERM or SIGINT (or the death of the process that started it); blocks."""
    _end_with_parent()
    uvicorn.run(
        build_app(config),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )


def _end_with_parent() -> None:
    """Ask Linux for a SIGTERM when the starting process dies, however it dies."""
    parent = os.environ.get(PARENT_VARIABLE)
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if str(os.getppid()) != parent:  # it died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


_PR_SET_PDEATHSIG = 1
