"""The emulated engine's time model, free of clocks: every time is an argument.

Prefill costs a fixed time per uncached token and runs one at a time (compute-bound); decode
costs a fixed time per token for all running sequences at once (a batched step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimeModel:
    prefill_seconds_per_token: float = 0.0
    decode_seconds_per_token: float = 0.0
    slowdown: float = 1.0
    """How many times slower than the per-token costs this replica computes (1: as given)."""

    def __post_init__(self) -> None:
        if not self.slowdown > 0:
            raise ValueError("the slowdown must be a positive number")

    @property
    def decodes(self) -> bool:
        """Whether generated tokens take time at all."""
        return self.decode_seconds_per_token > 0

    def prefill_seconds(self, uncached_tokens: int) -> float:
        return uncached_tokens * self.prefill_seconds_per_token * self.slowdown

    def token_time(self, first_token_at: float, index: int) -> float:
        """When the token at `index` (0 is the first) of a sequence is produced."""
        return first_token_at + index * self.decode_seconds_per_token * self.slowdown


class PrefillLane:
    """The one prefill lane. A reservation is final: one aborted before it ran still holds
    its slot, so those behind it start no earlier than they were told."""

    def __init__(self) -> None:
        self._free_at = float("-inf")

    @property
    def free_at(self) -> float:
        return self._free_at

    def reserve(self, now: float, seconds: float) -> float:
        """Book `seconds` of prefill asked for at `now`; returns when that prefill ends."""
        if seconds <= 0:
            return now
        start = max(now, self._free_at)
        self._free_at = start + seconds
        return self._free_at
