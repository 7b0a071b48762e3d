"""The emulator's time model and its engine's scheduling, in one process on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from prefix_gateway.emulator.engine import Engine
from prefix_gateway.emulator.prefix_cache import PrefixCache
from prefix_gateway.emulator.sampler import Sampler
from prefix_gateway.emulator.timing import PrefillLane, TimeModel

BLOCK = 16


class FrozenClock:
    """Time stands still; every sleep asked for is recorded and returns at the next loop turn."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await asyncio.sleep(0)


class Latencies:
    def __init__(self) -> None:
        self.first_tokens: list[float] = []
        self.ends: list[float] = []

    def first_token(self, seconds: float) -> None:
        self.first_tokens.append(seconds)

    def finished(self, seconds: float) -> None:
        self.ends.append(seconds)


def engine(
    clock: FrozenClock,
    *,
    capacity: int = 1000,
    max_running: int = 8,
    prefill: float = 0.0,
    decode: float = 0.0,
    observer: Latencies | None = None,
) -> Engine:
    return Engine(
        PrefixCache(capacity, BLOCK),
        TimeModel(prefill, decode),
        Sampler(0),
        max_running=max_running,
        observer=observer,
        clock=clock,
        sleep=clock.sleep,
    )


def prompt(count: int, start: int = 0) -> list[int]:
    return list(range(start, start + count))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_time_model_prices_uncached_tokens_and_paces_decode() -> None:
    model = TimeModel(prefill_seconds_per_token=0.001, decode_seconds_per_token=0.02)
    assert model.prefill_seconds(250) == pytest.approx(0.25)
    assert model.token_time(10.0, 0) == 10.0
    assert model.token_time(10.0, 5) == pytest.approx(10.1)


def test_prefill_lane_runs_one_prefill_at_a_time() -> None:
    lane = PrefillLane()
    assert lane.reserve(0.0, 1.0) == 1.0
    assert lane.reserve(0.5, 1.0) == 2.0  # queued behind the first
    assert lane.reserve(5.0, 0.5) == 5.5  # the lane was idle
    assert lane.reserve(5.1, 0.0) == 5.1  # nothing to compute, no wait
    assert lane.free_at == 5.5


def test_zero_cost_requests_never_sleep() -> None:
    clock = FrozenClock()
    replica = engine(clock)

    async def one(index: int) -> str:
        async with replica.run(prompt(50, index * 100), 30) as run:
            if index % 2:
                return "".join([token async for token in run.stream()])
            return await run.complete()

    async def scenario() -> list[str]:
        return await asyncio.gather(*(one(index) for index in range(20)))

    texts = asyncio.run(scenario())
    assert clock.sleeps == []
    assert len(texts) == 20
    assert replica.stats.finished["length"] == 20
    assert replica.stats.generation_tokens == 600
    assert replica.running == replica.waiting == replica.cache.pinned_blocks == 0


def test_uncached_prefills_queue_up_and_cached_ones_are_short() -> None:
    clock = FrozenClock()
    latencies = Latencies()
    replica = engine(clock, prefill=0.001, observer=latencies)

    async def one(tokens: list[int]) -> int:
        async with replica.run(tokens, 1) as run:
            await run.complete()
            return run.cached_tokens

    async def scenario() -> list[int]:
        cold = await asyncio.gather(one(prompt(100)), one(prompt(100, 1000)))
        clock.now = 10.0
        warm = await one(prompt(100))
        return [*cold, warm]

    assert asyncio.run(scenario()) == [0, 0, 96]
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.004])
    assert latencies.first_tokens == pytest.approx([0.1, 0.2, 0.004])
    assert len(latencies.ends) == 3


def test_decode_paces_each_token_from_the_first() -> None:
    clock = FrozenClock()
    replica = engine(clock, decode=0.01)

    async def scenario() -> list[str]:
        async with replica.run(prompt(20), 4) as run:
            return [token async for token in run.stream()]

    assert len(asyncio.run(scenario())) == 4
    assert clock.sleeps == pytest.approx([0.01, 0.02, 0.03])


def run_held(replica: Engine, tokens: list[int], max_tokens: int) -> tuple[
    Callable[[], Awaitable[int]], asyncio.Event, asyncio.Event
]:
    """A sequence that, once admitted, holds its slot until `release` is set."""
    admitted, release = asyncio.Event(), asyncio.Event()

    async def body() -> int:
        async with replica.run(tokens, max_tokens) as run:
            admitted.set()
            await release.wait()
            await run.complete()
            return run.cached_tokens

    return body, admitted, release


def test_sequences_beyond_max_running_wait_in_arrival_order() -> None:
    clock = FrozenClock()
    replica = engine(clock, max_running=1)
    order: list[str] = []

    async def scenario() -> None:
        holder, admitted, release = run_held(replica, prompt(20), 2)
        first = asyncio.ensure_future(holder())
        await admitted.wait()

        async def later(name: str) -> None:
            async with replica.run(prompt(20, 100), 2) as run:
                order.append(name)
                await run.complete()

        waiters = [asyncio.ensure_future(later(name)) for name in ("b", "c", "d")]
        await settle()
        assert (replica.running, replica.waiting) == (1, 3)
        release.set()
        await asyncio.gather(first, *waiters)

    asyncio.run(scenario())
    assert order == ["b", "c", "d"]
    assert (replica.running, replica.waiting) == (0, 0)


def test_a_sequence_waits_for_cache_blocks_held_by_running_ones() -> None:
    clock = FrozenClock()
    replica = engine(clock, capacity=8)

    async def scenario() -> None:
        holder, admitted, release = run_held(replica, prompt(60), 60)  # 8 blocks
        first = asyncio.ensure_future(holder())
        await admitted.wait()
        second_holder, second_admitted, second_release = run_held(replica, prompt(20, 500), 5)
        second = asyncio.ensure_future(second_holder())
        await settle()
        assert (replica.running, replica.waiting) == (1, 1)
        assert replica.cache.usage == 1.0
        release.set()
        await second_admitted.wait()
        assert (replica.running, replica.waiting) == (1, 0)
        second_release.set()
        await asyncio.gather(first, second)

    asyncio.run(scenario())
    assert replica.cache.pinned_blocks == 0


def test_cancelling_a_waiting_sequence_takes_it_off_the_queue() -> None:
    clock = FrozenClock()
    replica = engine(clock, max_running=1)

    async def scenario() -> None:
        holder, admitted, release = run_held(replica, prompt(20), 2)
        first = asyncio.ensure_future(holder())
        await admitted.wait()
        queued_holder, queued_admitted, _ = run_held(replica, prompt(20, 100), 2)
        queued = asyncio.ensure_future(queued_holder())
        await settle()
        assert replica.waiting == 1
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        assert (replica.running, replica.waiting) == (1, 0)
        release.set()
        await first
        assert not queued_admitted.is_set()

    asyncio.run(scenario())
    assert replica.stats.finished == {"stop": 0, "length": 1, "abort": 1}
    assert replica.running == 0


def test_cancelling_a_decoding_sequence_releases_it_and_counts_an_abort() -> None:
    clock = FrozenClock()
    replica = engine(clock, decode=0.05)
    streamed: list[str] = []

    async def reader() -> None:
        async with replica.run(prompt(40), 100) as run:
            async for token in run.stream():
                streamed.append(token)

    async def scenario() -> None:
        task = asyncio.ensure_future(reader())
        while len(streamed) < 3:
            await asyncio.sleep(0)
        assert replica.running == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert replica.running == 0 and replica.cache.pinned_blocks == 0
    assert replica.stats.finished["abort"] == 1
    assert replica.stats.generation_tokens == 3
    assert replica.cache.cached_blocks == 2  # the prompt's blocks were computed and stay cached


def test_a_sequence_that_can_never_fit_is_refused() -> None:
    replica = engine(FrozenClock(), capacity=4)
    assert replica.fits(60, 5) and not replica.fits(60, 6) and not replica.fits(0, 1)

    async def scenario() -> None:
        async with replica.run(prompt(60), 6):
            pass

    with pytest.raises(ValueError, match="never fit"):
        asyncio.run(scenario())
