"""Numbers per candidate of one model, read from its backends when asked: their load and
their pending prefill, as mappings the policy reads without anyone filling them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol


class Counted(Protocol):
    """What the views read of a backend (`prefix_gateway.backends.pool.Backend`, which builds
    them)."""

    @property
    def load(self) -> int: ...

    @property
    def pending_prefill(self) -> int: ...

    @property
    def fleet_pending_prefill(self) -> int: ...


class _PerBackend(Mapping[str, int]):
    """One number per candidate, read from the backend when asked: a mapping nobody fills.
    Subclasses implement `get` themselves: the policy calls it several times a decision."""

    __slots__ = ("_by_name",)

    def __init__(self, by_name: Mapping[str, Counted]) -> None:
        self._by_name = by_name

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


class LoadView(_PerBackend):
    """Each candidate's current load."""

    __slots__ = ()

    def __getitem__(self, name: str) -> int:
        return self._by_name[name].load

    def get(self, name: str, default: int = 0) -> int:  # type: ignore[override]
        backend = self._by_name.get(name)
        return default if backend is None else backend.load


class PendingPrefillView(_PerBackend):
    """Each candidate's pending prefill in blocks: this gateway's and the fleet's."""

    __slots__ = ()

    def __getitem__(self, name: str) -> int:
        backend = self._by_name[name]
        return backend.pending_prefill + backend.fleet_pending_prefill

    def get(self, name: str, default: int = 0) -> int:  # type: ignore[override]
        backend = self._by_name.get(name)
        if backend is None:
            return default
        return backend.pending_prefill + backend.fleet_pending_prefill
