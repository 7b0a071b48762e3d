"""An emulated replica in a child process on a free loopback port, for tests and demos:
`with EmulatorProcess("--cache-blocks", "64") as replica: ...`.
"""

from __future__ import annotations

import os

from prefix_gateway.emulator.server import PARENT_VARIABLE
from prefix_gateway.processes import ChildProcess


class EmulatorProcess(ChildProcess):
    def __init__(
        self,
        *args: str,
        name: str = "emulated-model",
        host: str = "127.0.0.1",
        port: int = 0,
        startup_seconds: float = 60.0,
        stop_seconds: float = 5.0,
        end_with_parent: bool = False,
    ) -> None:
        """`end_with_parent`: the replica ends when this process does, however it ends (start
        it from the main thread then: Linux ties it to the starting thread)."""
        super().__init__(
            "prefix_gateway.emulator",
            ("--name", name, *args),
            host=host,
            port=port,
            env={PARENT_VARIABLE: str(os.getpid())} if end_with_parent else None,
            startup_seconds=startup_seconds,
            stop_seconds=stop_seconds,
        )
        self.name = name
