"""What the gateways of a fleet agree on besides the index and the sessions: which backend a
shared prompt was first sent to while the index did not show it (a claim: the first writer
wins, for a short while), and how many recent requests carried each shared prompt. One gateway
alone has nothing to agree with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet's answer for one request."""

    claimed: str | None = None
    """The backend a gateway (this one or another) sent the request's shared prompt to first,
    while the claim lives: it counts as holding the prompt."""
    prompt_count: float | None = None
    """The fleet's decaying count of requests that carried the request's shared prompt (this
    one included when counted); None when it has none."""


class Agreement(Protocol):
    async def consult(
        self, model: str, first_block: int, claim_key: int, prompt_key: int | None, count: bool
    ) -> FleetView | None:
        """The claim on `claim_key` and the count of shared prompt `prompt_key` (counting this
        request when `count`), for a prompt whose chain starts with `first_block`; None when
        the fleet cannot answer now."""
        ...

    def claim(self, model: str, first_block: int, claim_key: int, backend: str) -> None:
        """Claim `claim_key` for `backend` unless someone did first (in the background)."""
        ...
