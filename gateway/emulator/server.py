"""Serving the emulated replica with uvicorn."""

from __future__ import annotations

import uvicorn

from gateway.emulator.app import build_app
from gateway.emulator.config import EmulatorConfig

# In-flight requests get this long to finish after SIGTERM; then they are aborted.
GRACEFUL_SHUTDOWN_SECONDS = 5


def serve(config: EmulatorConfig) -> None:
    """Serve until SIGTERM or SIGINT; blocks."""
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
