"""What each gateway of a fleet knows alone, exchanged through Redis every `_SYNC_SECONDS` in
one script call: its requests in flight, its pending prefill and its recent requests per
backend, and how many recent requests carried a shared prompt. So each gateway's load bound,
hot checks and tie-breaks see the fleet's traffic (docs/redis.md, fleet behaviour).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Mapping
from typing import Protocol, cast

from redis.asyncio import Redis

from prefix_gateway.backends.engine_load import EngineLoadScraper
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.state.redis.connection import RedisClient, RedisLink, RedisUnavailable
from prefix_gateway.state.redis.keys import KeySpace

log = logging.getLogger("prefix_gateway.redis")

# Fresher than the shortest requests, to keep a burst of new conversations off one backend
# (the interval is chosen in docs/redis.md).
_SYNC_SECONDS = 0.02
# Another gateway's counts stop counting when it has not written for this long (it stopped,
# or lost Redis), and its field is deleted after `_FORGOTTEN_MS`.
_STALE_MS = 1_000
_FORGOTTEN_MS = 60_000
# The most gateways seen stands this long: one that paused for a second must not make the
# others' shares of a tenant's limit larger (docs/tenants.md).
_FLEET_SIZE_SECONDS = 10.0

LOAD_SCRIPT = """
-- One gateway's requests in flight per backend in, every other live gateway's out.
-- KEYS[1]  the fleet's load hash: one field per gateway process
-- ARGV[1]  this gateway's id
-- ARGV[2]  its counts: "<backend> <requests>\\n" per backend with requests in flight
-- ARGV[3]  ms after which a gateway's counts stop counting
-- ARGV[4]  ms after which its field is deleted (and the hash's TTL)
-- Returns  the counts of every other gateway that wrote within ARGV[3] ms
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], now .. '\\n' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
local fresh, forgotten = now - tonumber(ARGV[3]), now - tonumber(ARGV[4])
local others = {}
local fields = redis.call('HGETALL', KEYS[1])
for position = 1, #fields, 2 do
  local gateway, value = fields[position], fields[position + 1]
  if gateway ~= ARGV[1] then
    local stamp = tonumber(string.match(value, '^(%d+)'))
    if stamp == nil or stamp < forgotten then
      redis.call('HDEL', KEYS[1], gateway)
    elseif stamp >= fresh then
      others[#others + 1] = value
    end
  end
end
return others
"""


class TrafficExchange(Protocol):
    """The router's recent traffic, as the exchange reads and fills it."""

    def own(self) -> tuple[dict[str, float], float]:
        """This gateway's recent requests per backend, and recent requests with a shared
        prompt."""
        ...

    def set_fleet(self, recent: dict[str, float], prompts_total: float) -> None:
        """The other gateways' (empty when the exchange failed)."""
        ...


def own_counts(
    pool: BackendPool, recent: Mapping[str, float] | None = None, prompts: float = 0.0
) -> str:
    """This gateway's line: `<backend> <in flight>` per busy backend, then
    `~<backend> <pending prefill> <recent>` per backend with either, then `~ <prompts>`. The
    traffic lines carry a decimal point, so a gateway that reads in-flight lines alone skips
    them."""
    lines = []
    traffic = []
    for backend in pool.backends:
        name = backend.name
        if " " in name or "\n" in name:
            continue
        if backend.in_flight > 0:
            lines.append(f"{name} {backend.in_flight}\n")
        count = recent.get(name, 0.0) if recent is not None else 0.0
        if backend.pending_prefill > 0 or count >= 0.001:
            traffic.append(f"~{name} {backend.pending_prefill} {count:.3f}\n")
    return "".join(lines) + "".join(traffic) + f"~ {prompts:.3f}\n"


class FleetLoad:
    """The other gateways' lines, summed per backend."""

    def __init__(self, values: list[bytes]) -> None:
        self.in_flight: dict[str, int] = {}
        self.pending_prefill: dict[str, int] = {}
        self.recent: dict[str, float] = {}
        self.prompts = 0.0
        for value in values:
            for line in value.decode(errors="replace").split("\n")[1:]:
                if line.startswith("~"):
                    self._traffic(line[1:])
                    continue
                name, _, count = line.rpartition(" ")
                if name and count.isdigit():
                    self.in_flight[name] = self.in_flight.get(name, 0) + int(count)

    def _traffic(self, line: str) -> None:
        fields = line.split(" ")
        try:
            if len(fields) == 2 and not fields[0]:
                self.prompts += float(fields[1])
            elif len(fields) == 3 and fields[0]:
                name, pending, recent = fields[0], int(fields[1]), float(fields[2])
                self.pending_prefill[name] = self.pending_prefill.get(name, 0) + pending
                self.recent[name] = self.recent.get(name, 0.0) + recent
        except ValueError:
            return


class SharedLoad:
    """Writes this gateway's in-flight counts and hands the others' to the load picture."""

    def __init__(
        self,
        client: RedisClient,
        link: RedisLink,
        keys: KeySpace,
        pool: BackendPool,
        engine_load: EngineLoadScraper,
        traffic: TrafficExchange | None = None,
        interval: float = _SYNC_SECONDS,
        stale_ms: int = _STALE_MS,
    ) -> None:
        self._link = link
        self._stale_ms = stale_ms
        self._key = keys.fleet_load()
        self._pool = pool
        self._engine_load = engine_load
        self._traffic = traffic
        self._interval = interval
        self.exchanged_at = -math.inf
        """`time.monotonic()` of the last exchange that answered."""
        self.gateways: int | None = None
        """Gateway processes that wrote within `stale_ms`, this one included: the most seen
        by the exchanges of the last `_FLEET_SIZE_SECONDS` that answered, or the last one's
        count (None before one has answered). Each gateway's share of a fleet-wide limit while
        Redis is away (docs/tenants.md)."""
        self._most_seen_at = -math.inf
        # One field per process: the workers of one pod are gateways of the fleet too.
        self.gateway_id = secrets.token_hex(8)
        self._script = cast(Redis, client).register_script(LOAD_SCRIPT)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="redis-fleet-load")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def sync(self) -> None:
        """One exchange; with Redis away the others' counts are dropped, not kept stale."""
        traffic = self._traffic
        counts = own_counts(self._pool, *(traffic.own() if traffic is not None else ()))
        try:
            reply = await self._link.call(
                "load",
                lambda: self._script(
                    [self._key], [self.gateway_id, counts, self._stale_ms, _FORGOTTEN_MS]
                ),
            )
        except RedisUnavailable:
            self._apply(FleetLoad([]))
            return
        self.exchanged_at = time.monotonic()
        self._counted(len(reply) + 1)
        self._apply(FleetLoad(list(reply)))

    def _counted(self, gateways: int) -> None:
        now = self.exchanged_at
        fresh = now - self._most_seen_at <= _FLEET_SIZE_SECONDS
        if self.gateways is None or gateways >= self.gateways or not fresh:
            self.gateways = gateways
            self._most_seen_at = now

    def _apply(self, others: FleetLoad) -> None:
        self._engine_load.set_fleet(others.in_flight)
        for backend in self._pool.backends:
            backend.fleet_prefill_reported(others.pending_prefill.get(backend.name, 0))
        if self._traffic is not None:
            self._traffic.set_fleet(others.recent, others.prompts)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.sync()
            except Exception:  # the exchange must never stop the loop
                log.exception("fleet load exchange failed")
