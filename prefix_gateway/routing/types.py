"""What routing works with: the policy's view in, its decision out, and what it learns from."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


class Route(Enum):
    """Why a backend was chosen: the metric label, the response header and what tests check."""

    SESSION = "session"
    OWNER = "owner"
    PREFIX = "prefix"
    HASH = "hash"
    OVERFLOW = "overflow"
    FALLBACK = "fallback"
    RETRY = "retry"
    PREVIOUS_RESPONSE = "previous_response"
    """To the replica that stored the response a request names: no other can answer it."""
    ADAPTER = "adapter"
    """A LoRA adapter's request with no prefix worth routing on: the ring from the adapter."""
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    FASTER = "faster"
    """Moved from the rule's choice to a replica predicted to give the first token sooner."""


# The values made for every request are not frozen: a frozen dataclass's `__init__` costs
# several times a plain one's (one `object.__setattr__` per field). Nothing writes them.
@dataclass(slots=True)
class RoutingState:
    candidates: Sequence[str]
    """Healthy backends serving the model, not yet tried for this request."""
    loads: Mapping[str, int]
    """Load per candidate: requests in flight (plus engine-reported queue where known)."""
    hashes: Sequence[int] = ()
    """The prompt's block hash chain."""
    matched: Mapping[str, int] = field(default_factory=dict)
    """Matched prefix depth in blocks per backend, from the index."""
    affinity_key: int = 0
    private_from: int = 0
    """The block where the request's own part begins (after a shared system prompt)."""
    first_turn: bool = False
    """The request carries no answer of its own yet (a conversation's first message): a match
    past `private_from` is another request's, never this one's history."""
    sticky: str | None = None
    """The backend bound to the request's session key, if any."""
    keyed: bool = False
    """The request carries a session key (its affinity key), bound to a backend or not yet."""
    recent: Mapping[str, float] = field(default_factory=dict)
    """Recent request counts per backend (decaying), for spreading ties."""
    members: Set[str] | None = None
    """`candidates` as a set, where the caller keeps one (else a policy builds it)."""
    total_load: int | None = None
    """The candidates' summed load, where the caller keeps it (else a policy sums it)."""
    recent_total: float | None = None
    """The candidates' summed recent counts, where the caller keeps it."""
    shared_share: float = 0.0
    """The share of recent requests that carried this request's shared prompt, this one
    counted (0 when it has none): see `prefix_gateway.routing.traffic.Traffic`."""
    sequence: int = 0
    """The request's number among those routed (a round robin's turn)."""
    adapter_key: int | None = None
    """The ring key of the LoRA adapter the request names (None: a base model): where no
    prefix is known, its requests gather on as few replicas as their load needs."""
    pending_prefill: Mapping[str, int] = field(default_factory=dict)
    """Prompt blocks sent to each candidate and not computed yet, by the caller's estimate
    (unmatched blocks until the first byte): how long a new prefill would wait there."""

    prompt_tokens: int = 0
    """The prompt's length in tokens, by the gateway's estimate."""
    first_token: FirstTokenTimes | None = None
    """Each candidate's predicted time to first token (None: not predicting)."""

    def summed_load(self) -> int:
        """`total_load`, or the sum over the candidates when the caller keeps none."""
        if self.total_load is not None:
            return self.total_load
        loads = self.loads
        return sum(loads.get(name, 0) for name in self.candidates)


class FirstTokenTimes(Protocol):
    """What a policy asks of the learned time to first token
    (`prefix_gateway.routing.first_token.FirstTokenModel`)."""

    def seconds(self, backend: str, work_tokens: float) -> float | None:
        """The time to first token at `backend` for `work_tokens` to compute there, its own and
        those ahead of it (None: nothing learned yet)."""
        ...

    def spread(self, backend: str) -> float:
        """How uncertain `backend`'s predictions are (a standard error, seconds)."""
        ...

    def least_gain(self) -> float:
        """Seconds below which a sooner prediction is not worth a move."""
        ...

    def slowness(self) -> Mapping[str, float]:
        """The backends known to compute clearly slower than the fleet, each with how many
        times (empty on an even fleet)."""
        ...


@dataclass(slots=True)
class Decision:
    backend: str
    route: Route
    matched_blocks: int = 0
    load_bound: int = 0
    ahead_tokens: int | None = None
    """Prompt tokens sent to `backend` and not computed yet, as the decision saw them (None:
    the time to first token is not learned)."""
    predicted_seconds: float | None = None
    """Its predicted time to first token there (None: none)."""


class Policy(Protocol):
    def choose(self, state: RoutingState) -> Decision:
        """Pick one of `state.candidates`; there is always at least one."""
        ...


@dataclass(slots=True)
class Outcome:
    """What came back for a routed request, from the attempt that gave the client its answer."""

    status: int
    decision: Decision
    """The decision of that attempt (the first, or a retry's)."""
    tried: tuple[str, ...]
    """Every backend tried, in order."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    answer: str = ""
    """The first choice's text, as the next turn of a conversation carries it."""
    sent_at: float = math.inf
    """`time.perf_counter()` when the answering attempt was sent."""
    first_byte_at: float = 0.0
    """`time.perf_counter()` when its first byte came back (0: none came)."""
    completion_tokens: int | None = None
    accepted: tuple[str, ...] = ()
    """The backends tried that accepted the request (answered 2xx): its prompt is theirs."""
    answered: bool = False
    """The client was sent the first bytes of a successful answer."""
    relayed_tokens: int = 0
    """Generated tokens relayed to the client, as counted in a stream's events."""
