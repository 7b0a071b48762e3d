"""What the gateways of a fleet agree on besides the index and the sessions: which backend a
shared prompt was first sent to while the index did not show it (a claim: the first writer
wins, for a short while), how many recent requests carried each shared prompt, and where a
stream is computing one now (its prefill not done: a request for it there waits, at any
gateway). One gateway alone has nothing to agree with.
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
    computing: frozenset[str] = frozenset()
    """The backends where a gateway's stream is computing the shared prompt now."""


@dataclass(frozen=True, slots=True)
class SharedPrompt:
    """A request's shared prompt, as the fleet names it."""

    model: str
    first_block: int
    key: int
    """Its last block's hash."""
    blocks: int
    """Its length in blocks."""


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


class FleetPrefills(Protocol):
    """Where the fleet's streams are computing shared prompts (in the background, but for
    `computing`)."""

    def started(self, prompt: SharedPrompt, backend: str) -> None:
        """A stream of this gateway computes `prompt` on `backend` from now."""
        ...

    def done(self, prompt: SharedPrompt, backend: str) -> None:
        """Its prefill is over: `prompt` is cached on `backend` (or never will be by it)."""
        ...

    async def computing(self, prompt: SharedPrompt, backend: str) -> bool:
        """Whether a stream still computes `prompt` on `backend` (False when Redis cannot
        tell now)."""
        ...
