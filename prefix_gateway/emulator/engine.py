"""The emulated engine: admits sequences in arrival order while fewer than `max_running` run
and the cache can reserve their blocks, prefills them on one lane and paces their tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

from prefix_gateway.emulator.prefix_cache import CacheLease, PrefixCache, block_hashes
from prefix_gateway.emulator.sampler import Sampler
from prefix_gateway.emulator.timing import PrefillLane, TimeModel
from prefix_gateway.emulator.tokenizer import token_ids

FINISH_REASONS = ("stop", "length", "abort")


class LatencyObserver(Protocol):
    def first_token(self, seconds: float) -> None: ...

    def finished(self, seconds: float) -> None: ...


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))


class Run:
    """One admitted sequence, past its prefill: its counts and its paced tokens."""

    def __init__(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        tokens: list[str],
        first_token_at: float,
        time_model: TimeModel,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        flowing: asyncio.Event,
        stats: EngineStats,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.produced = 0
        self._tokens = tokens
        self._first_token_at = first_token_at
        self._time = time_model
        self._clock = clock
        self._sleep = sleep
        self._flowing = flowing
        self._stats = stats

    @property
    def max_tokens(self) -> int:
        return len(self._tokens)

    @property
    def generated(self) -> list[str]:
        return self._tokens[: self.produced]

    async def stream(self) -> AsyncIterator[str]:
        """Each token as soon as its decode step ends."""
        for index, token in enumerate(self._tokens):
            if index and self._time.decodes:
                await self._sleep_until(self._time.token_time(self._first_token_at, index))
            await self._flowing.wait()
            self.produced = index + 1
            # Counted as each token is produced, as vLLM counts each step's tokens.
            self._stats.generation_tokens += 1
            yield token

    async def complete(self) -> str:
        """The whole answer, once its last token is produced."""
        if self._time.decodes:
            last = self._time.token_time(self._first_token_at, len(self._tokens) - 1)
            await self._sleep_until(last)
        self.produced = len(self._tokens)
        self._stats.generation_tokens += self.produced
        return "".join(self._tokens)

    async def _sleep_until(self, deadline: float) -> None:
        delay = deadline - self._clock()
        if delay > 0:
            await self._sleep(delay)


@dataclass
class _Waiter:
    hashes: list[int]
    prompt_tokens: int
    max_tokens: int
    admitted: asyncio.Future[CacheLease]


class Engine:
    def __init__(
        self,
        cache: PrefixCache,
        time_model: TimeModel,
        sampler: Sampler,
        *,
        max_running: int,
        observer: LatencyObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        self.cache = cache
        self.time_model = time_model
        self.stats = EngineStats()
        self._sampler = sampler
        self._max_running = max_running
        self._observer = observer
        self._clock = clock
        self._sleep = sleep
        self._lane = PrefillLane()
        self._running = 0
        self._waiting: deque[_Waiter] = deque()
        self._flowing = asyncio.Event()
        self._flowing.set()

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    def stall(self, stalled: bool) -> None:
        """Stop producing tokens (as a hung engine behind a live API server does), or resume."""
        if stalled:
            self._flowing.clear()
        else:
            self._flowing.set()

    def slow_down(self, factor: float) -> None:
        """Compute `factor` times slower than the configured per-token costs from now on (1:
        as configured): prefills not yet booked and sequences admitted from now on."""
        self.time_model = replace(self.time_model, slowdown=factor)

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a sequence could ever run: its blocks fit an otherwise idle cache."""
        needed = self.cache.sequence_blocks(prompt_tokens, max_tokens)
        return prompt_tokens >= 1 and max_tokens >= 1 and needed <= self.cache.capacity_blocks

    @asynccontextmanager
    async def run(
        self, prompt_ids: Sequence[int], max_tokens: int, salt: str | None = None
    ) -> AsyncIterator[Run]:
        """Admit, prefill and hand over one sequence; leaving the block finishes it, as
        "length" when every token was produced and as "abort" otherwise."""
        if not self.fits(len(prompt_ids), max_tokens):
            raise ValueError("this sequence can never fit the cache")
        arrival = self._clock()
        hashes = block_hashes(prompt_ids, self.cache.block_size, salt=salt)
        lease = await self._admit(hashes, len(prompt_ids), max_tokens)
        run: Run | None = None
        try:
            now = self._clock()
            uncached = len(prompt_ids) - lease.cached_tokens
            first_token_at = self._lane.reserve(now, self.time_model.prefill_seconds(uncached))
            if first_token_at > now:
                await self._sleep(first_token_at - now)
            await self._flowing.wait()
            self.cache.publish(lease, hashes)
            self.stats.prompt_tokens += len(prompt_ids)
            if self._observer is not None:
                self._observer.first_token(first_token_at - arrival)
            run = Run(
                len(prompt_ids),
                lease.cached_tokens,
                self._sampler.sample(prompt_ids, max_tokens),
                first_token_at,
                self.time_model,
                self._clock,
                self._sleep,
                self._flowing,
                self.stats,
            )
            yield run
        finally:
            self._finish(lease, run, prompt_ids, hashes, arrival)

    def _finish(
        self,
        lease: CacheLease,
        run: Run | None,
        prompt_ids: Sequence[int],
        hashes: list[int],
        arrival: float,
    ) -> None:
        reason = "abort"
        if run is not None and run.produced == run.max_tokens:
            reason = "length"
            # Like vLLM, the last generated token's KV is never computed.
            held = [*prompt_ids, *token_ids(run.generated[:-1])]
            self.cache.publish(lease, block_hashes(held, self.cache.block_size, hashes))
            if self._observer is not None:
                self._observer.finished(self._clock() - arrival)
        self.stats.finished[reason] += 1
        self._release(lease)

    async def _admit(self, hashes: list[int], prompt_tokens: int, max_tokens: int) -> CacheLease:
        if not self._waiting and self._running < self._max_running:
            lease = self.cache.admit(hashes, prompt_tokens, max_tokens)
            if lease is not None:
                self._running += 1
                return lease
        admitted: asyncio.Future[CacheLease] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(hashes, prompt_tokens, max_tokens, admitted)
        self._waiting.append(waiter)
        try:
            return await admitted
        except asyncio.CancelledError:
            self.stats.finished["abort"] += 1
            if admitted.done() and not admitted.cancelled():
                # Admitted in the same loop turn as the caller went away.
                self._release(admitted.result())
            else:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                self._admit_waiting()
            raise

    def _release(self, lease: CacheLease) -> None:
        self.cache.release(lease)
        self._running -= 1
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self._waiting and self._running < self._max_running:
            head = self._waiting[0]
            if head.admitted.done():
                # Its caller was cancelled and has not yet run to take itself off the queue.
                self._waiting.popleft()
                continue
            lease = self.cache.admit(head.hashes, head.prompt_tokens, head.max_tokens)
            if lease is None:
                return
            self._waiting.popleft()
            self._running += 1
            head.admitted.set_result(lease)
