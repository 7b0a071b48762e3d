"""Several emulated replicas of one model: for `serve --emulate N`, tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from prefix_gateway.emulator.process import EmulatorProcess
from prefix_gateway.processes import start_together


class EmulatedReplicas:
    """`count` emulated replicas of one model on free loopback ports, seeded apart."""

    def __init__(
        self,
        count: int,
        model: str = "emulated-model",
        args: Sequence[str] = (),
        host: str = "127.0.0.1",
        end_with_parent: bool = False,
    ) -> None:
        self.replicas = [
            EmulatorProcess(
                "--seed",
                str(position),
                *args,
                name=model,
                host=host,
                end_with_parent=end_with_parent,
            )
            for position in range(count)
        ]

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def start(self) -> EmulatedReplicas:
        start_together(self.replicas)
        return self

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def tracebacks(self) -> list[str]:
        """Every traceback a replica logged (see `ChildProcess.tracebacks`)."""
        return [trace for replica in self.replicas for trace in replica.tracebacks()]

    def expect_log(self, pattern: str) -> EmulatedReplicas:
        """Allow, in every replica's log, the error records `pattern` is found in (see
        `ChildProcess.expect_log`)."""
        for replica in self.replicas:
            replica.expect_log(pattern)
        return self

    def __enter__(self) -> EmulatedReplicas:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
