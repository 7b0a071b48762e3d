"""Requests in flight, exchanged between the gateways of a fleet through Redis every
`_SYNC_SECONDS` in one script call, so each gateway's load bound sees the others' requests
(docs/redis.md, fleet behaviour).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import cast

from redis.asyncio import Redis

from gateway.backends.engine_load import EngineLoadScraper
from gateway.backends.pool import BackendPool
from gateway.state.redis.connection import RedisClient, RedisLink, RedisUnavailable
from gateway.state.redis.keys import KeySpace

log = logging.getLogger("gateway.redis")

# Fresher than the shortest requests, to keep a burst of new conversations off one backend
# (the interval is chosen in docs/redis.md).
_SYNC_SECONDS = 0.02
# Another gateway's counts stop counting when it has not written for this long (it stopped,
# or lost Redis), and its field is deleted after `_FORGOTTEN_MS`.
_STALE_MS = 1_000
_FORGOTTEN_MS = 60_000

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


def own_counts(pool: BackendPool) -> str:
    """This gateway's requests in flight, one `<backend> <count>` line per busy backend."""
    return "".join(
        f"{backend.name} {backend.in_flight}\n"
        for backend in pool.backends
        if backend.in_flight > 0 and " " not in backend.name and "\n" not in backend.name
    )


def parse_counts(values: list[bytes]) -> dict[str, int]:
    """The other gateways' counts, summed per backend."""
    totals: dict[str, int] = {}
    for value in values:
        for line in value.decode(errors="replace").split("\n")[1:]:
            name, _, count = line.rpartition(" ")
            if name and count.isdigit():
                totals[name] = totals.get(name, 0) + int(count)
    return totals


class SharedLoad:
    """Writes this gateway's in-flight counts and hands the others' to the load picture."""

    def __init__(
        self,
        client: RedisClient,
        link: RedisLink,
        keys: KeySpace,
        pool: BackendPool,
        engine_load: EngineLoadScraper,
        interval: float = _SYNC_SECONDS,
    ) -> None:
        self._link = link
        self._key = keys.fleet_load()
        self._pool = pool
        self._engine_load = engine_load
        self._interval = interval
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
        counts = own_counts(self._pool)
        try:
            reply = await self._link.call(
                "load",
                lambda: self._script(
                    [self._key], [self.gateway_id, counts, _STALE_MS, _FORGOTTEN_MS]
                ),
            )
        except RedisUnavailable:
            self._engine_load.set_fleet({})
            return
        self._engine_load.set_fleet(parse_counts(list(reply)))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.sync()
            except Exception:  # the exchange must never stop the loop
                log.exception("fleet load exchange failed")
