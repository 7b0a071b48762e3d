"""One replica as this gateway knows it (`Backend`: health, load, the work running on it) and
the groups of replicas serving one model (`ModelPool`), whose load tallies follow their
members'. The pool that holds them is `prefix_gateway.backends.pool`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prefix_gateway.backends.load_views import LoadView, PendingPrefillView


class Work(Protocol):
    """An attempt running on a backend, as its health sees it."""

    sent_at: float
    """`time.monotonic()` when it was sent."""
    blocks_ahead: int
    """Prompt blocks the backend had to compute before this one's first byte, its own included."""
    first_byte_at: float
    """`time.perf_counter()` of its first byte; 0 while it waits for one."""
    judged_from: float
    """`time.monotonic()` from which the backend's silence counts against it for this work:
    when it was sent, or when it last stopped waiting on its client."""

    @property
    def awaiting_client(self) -> bool:
        """It waits for its client to read: no evidence against the backend meanwhile."""
        ...

    def stop(self) -> None:
        """End it: before its first byte it moves to another backend, after it fails."""
        ...


@dataclass(eq=False)
class Backend:
    """One replica as this gateway knows it. Only this module writes its fields: the other
    modules report what happened through the methods below, named after the event, so that
    each rule (the load tallies, what an ejection clears) is kept in one place."""

    name: str
    url: str
    models: frozenset[str] = frozenset()
    pinned_model: str | None = None
    parents: Mapping[str, str] = field(default_factory=dict)
    """The LoRA adapters among `models`, each with the base model its `/v1/models` names as
    `parent`."""
    context_lengths: Mapping[str, int] = field(default_factory=dict)
    """Each model's longest prompt and answer together (`max_model_len`), as `/v1/models`
    says where the engine reports it."""
    healthy: bool = False
    source: str = "static"
    """Who added it: `static`, `admin`, or the discovery source that found it."""
    credentialed: bool = True
    """It gets `--upstream-api-key`: the operator configured it (flags, config, discovery),
    or its admin entry asked for the key."""
    draining: bool = False
    idle: asyncio.Event | None = field(default=None, repr=False)
    """Set when a draining backend's last request in flight ends."""
    ejected: bool = False
    """Taken out by failures (not merely starting): readmitted after enough passed probes."""
    probe_streak: int = 0
    """Consecutive probe results of one kind: > 0 passed, < 0 failed."""
    failures: int = 0
    """Failed requests in a row; a good answer resets it (see prefix_gateway.backends.health)."""
    groups: list[ModelPool] = field(default_factory=list, repr=False)
    """The candidate groups it is in now, whose load tallies follow its own."""
    pending_prefill: int = field(default=0, repr=False)
    """Unmatched prompt blocks of this gateway's requests to it that have no first byte yet."""
    fleet_pending_prefill: int = field(default=0, repr=False)
    """The other gateways' pending prefill there, as of the last exchange through Redis."""
    work: set[Work] = field(default_factory=set, repr=False)
    """This gateway's attempts running on it now."""
    progressed_at: float = field(default=0.0, repr=False)
    """`time.monotonic()` when it last produced anything: a byte of a response, or tokens its
    engine counted between two scrapes."""
    stalled: bool = False
    """It answers probes but produced nothing while requests waited on it: out of routing until
    an inference probe passes."""
    ejected_why: str = ""
    last_probe_error: str = ""
    """Why its last failed health probe failed; kept once it passes again."""
    probe_failing: bool = False
    """Its last health probe failed."""
    _in_flight: int = field(default=0, repr=False)
    _queued: int = field(default=0, repr=False)

    @property
    def load(self) -> int:
        return self._in_flight + self._queued

    @property
    def in_flight(self) -> int:
        """Requests this gateway has sent it that have not ended."""
        return self._in_flight

    @property
    def queued(self) -> int:
        """Requests waiting in the engine's own queue, where scraped."""
        return self._queued

    def leased(self) -> None:
        """An attempt took a lease here: one more request in flight."""
        self._in_flight += 1
        for group in self.groups:
            group.total_load += 1

    def released(self) -> None:
        """An attempt's lease ended; the last one of a draining backend sets `idle`."""
        self._in_flight -= 1
        for group in self.groups:
            group.total_load -= 1
        if self.idle is not None and self._in_flight == 0:
            self.idle.set()

    def load_sampled(self, queued: int) -> None:
        """The requests there that this gateway did not send, as the engine's last scrape and
        the other gateways' counts put them."""
        delta = queued - self._queued
        if delta:
            self._queued = queued
            for group in self.groups:
                group.total_load += delta

    def prefill_queued(self, blocks: int) -> None:
        """An attempt here waits for `blocks` of its prompt to be computed."""
        self.pending_prefill += blocks

    def prefill_ended(self, blocks: int) -> None:
        """An attempt's `blocks` are computed (its first byte came) or will not be."""
        self.pending_prefill -= blocks

    def fleet_prefill_reported(self, blocks: int) -> None:
        """The other gateways' pending prefill here, just read from Redis."""
        self.fleet_pending_prefill = blocks

    def attempt_sent(self, work: Work) -> None:
        self.work.add(work)

    def attempt_ended(self, work: Work) -> None:
        self.work.discard(work)

    def progressed(self, at: float) -> None:
        """It produced a byte at `at`. Called once per streamed chunk: a store, nothing more."""
        self.progressed_at = at

    def generated_since(self, at: float) -> None:
        """Its engine counted new tokens at some time after `at` (its previous scrape)."""
        if at > self.progressed_at:
            self.progressed_at = at

    def probe_passed(self) -> int:
        """One more passed probe; the passes in a row."""
        self.probe_streak = max(self.probe_streak, 0) + 1
        return self.probe_streak

    def probe_failed(self) -> int:
        """One more failed probe; the failures in a row."""
        self.probe_streak = min(self.probe_streak, 0) - 1
        return -self.probe_streak

    def probe_answered(self, error: str) -> bool:
        """A health probe ended, failed for `error` or passed (""); True when it failed and
        the one before had not: the first of a run of failures."""
        first = bool(error) and not self.probe_failing
        self.probe_failing = bool(error)
        if error:
            self.last_probe_error = error
        return first

    def request_succeeded(self) -> None:
        if self.failures:
            self.failures = 0

    def request_failed(self) -> int:
        """One more failed request; the failures in a row."""
        self.failures += 1
        return self.failures

    def stall(self) -> None:
        """It produced nothing while requests waited: only an inference probe clears this."""
        self.stalled = True

    def eject(self, why: str) -> None:
        """Taken out by failures: its probes count anew towards readmission."""
        self.ejected = True
        self.ejected_why = why
        self.probe_streak = 0

    def readmit(self) -> None:
        """Back in routing with a clean record, having passed one probe at least."""
        self.ejected = False
        self.ejected_why = ""
        self.stalled = False
        self.failures = 0
        self.probe_streak = max(self.probe_streak, 1)


class ModelPool:
    """The backends serving one model now, with their summed load kept up to date by every
    change of a backend's load, so that the load bound costs O(1) instead of a sum."""

    __slots__ = (
        "adapter_key",
        "backends",
        "by_name",
        "loads",
        "members",
        "names",
        "pending_prefill",
        "total_load",
    )

    def __init__(self, backends: list[Backend], adapter_key: int | None = None) -> None:
        self.backends = backends
        self.adapter_key = adapter_key
        """The ring key of a LoRA adapter's group: its requests gather on few replicas."""
        self.names = tuple(backend.name for backend in backends)
        self.members = frozenset(self.names)
        self.by_name = {backend.name: backend for backend in backends}
        self.loads = LoadView(self.by_name)
        self.pending_prefill = PendingPrefillView(self.by_name)
        self.total_load = sum(backend.load for backend in backends)

    def having(self, room: Callable[[Backend], bool]) -> ModelPool:
        """The backends `room` admits, as a group of their own (this one when it admits all);
        a group made here is not kept up to date: it serves one decision."""
        chosen = [backend for backend in self.backends if room(backend)]
        if len(chosen) == len(self.backends):
            return self
        return ModelPool(chosen, self.adapter_key)
