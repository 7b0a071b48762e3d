"""The clock is injected so that tests and the replayer can drive time themselves."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def __call__(self) -> float: ...


# The C function itself, not a wrapper: it is read several times per request.
monotonic: Clock = time.monotonic


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
