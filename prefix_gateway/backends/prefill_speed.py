"""How fast the replicas prefill: prompt blocks per second, from recent first bytes. The stall
watch judges a wait by it, and each attempt reports its first byte to it.
"""

from __future__ import annotations

_WEIGHT = 0.1
"""Of each new first byte in the prefill speed (an exponential average)."""


class PrefillSpeed:
    """Prompt blocks per second the replicas prefill, from recent first bytes.

    It starts from a cautious guess, so that a long first prompt is not taken for a stall, and
    underestimates rather than over: a first byte's time includes more than the prefill.
    """

    def __init__(self, guess_blocks_per_second: float) -> None:
        self.blocks_per_second = guess_blocks_per_second

    def observe(self, blocks: int, seconds: float) -> None:
        if blocks <= 0 or seconds <= 0:
            return
        known = self.blocks_per_second
        self.blocks_per_second = known + _WEIGHT * (blocks / seconds - known)

    def expected(self, blocks: int) -> float:
        """Seconds a prefill of `blocks` takes at the recent speed."""
        return blocks / self.blocks_per_second
