"""Series values without a lock: in one process every series is written by the event loop's
thread alone, and prometheus_client's default takes a mutex on every increment (two calls
and a lock per count, a dozen counts per request)."""

from __future__ import annotations

from typing import Any

from prometheus_client import values


class LoopValue:
    """A series' value written by one thread; a scrape from another reads a whole float."""

    _multiprocess = False
    __slots__ = ("_exemplar", "_value")

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


def use_loop_values() -> None:
    """Series made from now on hold a `LoopValue` (not under several workers: theirs live in
    shared files)."""
    values.ValueClass = LoopValue
