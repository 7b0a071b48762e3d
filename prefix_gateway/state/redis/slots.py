"""Tenants' requests in flight across a fleet (docs/tenants.md, concurrency across a fleet): a
hash per tenant with one field per gateway process, holding that process's count, the order
in which it counted it and when it was written, by Redis's own clock. A count stands for a
time-to-live after it was written: a gateway rewrites its counts well within it, so a gateway
that died stops counting once it has passed. One script call admits a request, all or nothing,
or writes a process's count; it reads one field per gateway process at most.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from redis.asyncio import Redis

from prefix_gateway.state.redis.connection import RedisClient
from prefix_gateway.state.redis.keys import KeySpace

SLOTS_SCRIPT = """
-- Admit a tenant's request against its fleet-wide cap, or write one gateway's count.
-- KEYS[1]  the tenant's hash: one field per gateway process, "<ms by Redis TIME> <order> <count>"
-- ARGV[1]  this gateway process's id
-- ARGV[2]  'enter': admit if every live gateway's count, this one's ARGV[3] included, fits
--          ARGV[5]; 'write': write ARGV[3] as this gateway's count
-- ARGV[3]  this gateway's requests in flight for the tenant (the one entering included)
-- ARGV[4]  the order of that count among this gateway's: an older one than the field's is
--          not written (writes travel on several connections and may overtake each other)
-- ARGV[5]  the tenant's limit
-- ARGV[6]  ms a count stands after it was written (and the hash's TTL)
-- Returns  {1 if admitted or written else 0, the fleet's requests in flight with this count}
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local ttl = tonumber(ARGV[6])
local others, stored_order = 0, -1
local fields = redis.call('HGETALL', KEYS[1])
for position = 1, #fields, 2 do
  local gateway = fields[position]
  local stamp, order, count = string.match(fields[position + 1], '^(%d+) (%d+) (%d+)$')
  if gateway == ARGV[1] then
    stored_order = tonumber(order) or -1
  elseif stamp == nil or tonumber(stamp) < now - ttl then
    redis.call('HDEL', KEYS[1], gateway)
  else
    others = others + tonumber(count)
  end
end
local count, order = tonumber(ARGV[3]), tonumber(ARGV[4])
if ARGV[2] == 'enter' and others + count > tonumber(ARGV[5]) then
  return {0, others + count - 1}
end
if order > stored_order then
  if count > 0 then
    redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. order .. ' ' .. count)
  else
    redis.call('HDEL', KEYS[1], ARGV[1])
  end
end
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, others + count}
"""


@dataclass(frozen=True, slots=True)
class SlotsReply:
    done: bool
    """Admitted (`enter`), or written (`write`: always)."""
    fleet_in_flight: int
    """The tenant's requests in flight across the fleet, as this call left them."""


class RedisSlots:
    def __init__(self, client: RedisClient, keys: KeySpace, gateway_id: str, ttl: float) -> None:
        """`gateway_id`: this process's own, new at every start, so that a restarted process
        inherits nothing of a dead one; `ttl`: seconds a count stands after it was written."""
        self._keys = keys
        self._gateway_id = gateway_id
        self._ttl_ms = max(1, round(ttl * 1000))
        self._script = cast(Redis, client).register_script(SLOTS_SCRIPT)

    async def enter(self, tenant: str, count: int, order: int, limit: int) -> SlotsReply:
        """Admit a request if the fleet's count, this process's `count` (the request included)
        in place of its last, fits `limit`; `count` is then this process's."""
        return await self._run(b"enter", tenant, count, order, limit)

    async def write(self, tenant: str, count: int, order: int) -> SlotsReply:
        """This process's count for `tenant` is `count` (0: its field goes)."""
        return await self._run(b"write", tenant, count, order, 0)

    async def _run(
        self, mode: bytes, tenant: str, count: int, order: int, limit: int
    ) -> SlotsReply:
        args: list[bytes | int | str] = [self._gateway_id, mode, count, order, limit, self._ttl_ms]
        reply = await self._script([self._keys.slots(tenant)], args)
        return SlotsReply(int(reply[0]) == 1, int(reply[1]))
