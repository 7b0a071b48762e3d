"""A simulated replica: the emulator's admission, prefill lane and cache, in virtual time.

The pieces are used as `prefix_gateway.emulator.engine.Engine` uses them; the simulator passes `now`
in and schedules the times returned.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from prefix_gateway.emulator.prefix_cache import CacheLease, PrefixCache
from prefix_gateway.emulator.timing import PrefillLane, TimeModel
from prefix_gateway.replay.traces import TraceRequest
from prefix_gateway.routing.policies import Decision


@dataclass(slots=True)
class Flight:
    """One request from its arrival at a replica to its completion."""

    position: int
    request: TraceRequest
    decision: Decision
    arrived_at: float
    lease: CacheLease | None = None
    first_token_at: float = 0.0
    done_at: float = 0.0
    swapped: bool = False
    """Its adapter had to be brought into a slot, evicting another."""

    @property
    def backend(self) -> str:
        return self.decision.backend

    @property
    def cached_tokens(self) -> int:
        return self.lease.cached_tokens if self.lease is not None else 0


class AdapterSlots:
    """An engine's `--max-loras` slots: least recently used adapter out when another comes."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._resident: OrderedDict[str, None] = OrderedDict()

    def swapped_in(self, adapter: str) -> bool:
        """Bring `adapter` in for a request; whether that evicted another (a swap)."""
        if adapter in self._resident:
            self._resident.move_to_end(adapter)
            return False
        self._resident[adapter] = None
        if len(self._resident) > self._size:
            self._resident.popitem(last=False)
            return True
        return False


class SimulatedReplica:
    def __init__(
        self,
        name: str,
        cache: PrefixCache,
        time_model: TimeModel,
        max_running: int,
        max_loras: int = 1,
    ) -> None:
        self.name = name
        self._slots = AdapterSlots(max_loras)
        self.cache = cache
        self._time = time_model
        self._max_running = max_running
        self._lane = PrefillLane()
        self._running = 0
        self._waiting: deque[Flight] = deque()

    def fits(self, request: TraceRequest) -> bool:
        """Whether the request could ever run: its blocks fit an otherwise idle cache."""
        needed = self.cache.sequence_blocks(request.prompt_tokens, request.output_tokens)
        return needed <= self.cache.capacity_blocks

    def arrive(self, flight: Flight, now: float) -> list[Flight]:
        """Queue a request; returns the flights that start now (it, or none)."""
        self._waiting.append(flight)
        return self._admit_waiting(now)

    def prefilled(self, flight: Flight) -> None:
        """The prompt's blocks become reusable once its prefill has run."""
        assert flight.lease is not None
        self.cache.publish(flight.lease, flight.request.hashes)

    def finish(self, flight: Flight, now: float) -> list[Flight]:
        """Publish and release a finished flight; returns the waiting flights that start now."""
        assert flight.lease is not None
        self.cache.publish(flight.lease, flight.request.cached_at_finish)
        self.cache.release(flight.lease)
        self._running -= 1
        return self._admit_waiting(now)

    def _admit_waiting(self, now: float) -> list[Flight]:
        started: list[Flight] = []
        waiting = self._waiting
        while waiting and self._running < self._max_running:
            head = waiting[0]
            request = head.request
            lease = self.cache.admit(request.hashes, request.prompt_tokens, request.output_tokens)
            if lease is None:
                break
            waiting.popleft()
            self._running += 1
            head.lease = lease
            if request.adapter:
                head.swapped = self._slots.swapped_in(request.adapter)
            uncached = request.prompt_tokens - lease.cached_tokens
            head.first_token_at = self._lane.reserve(now, self._time.prefill_seconds(uncached))
            head.done_at = self._time.token_time(head.first_token_at, request.output_tokens - 1)
            started.append(head)
        return started
