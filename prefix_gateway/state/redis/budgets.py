"""Tenants' budgets per minute shared by the gateways of a fleet (docs/tenants.md): a hash per
tenant and budget holding its level and when that was, by Redis's own clock (so the gateways'
clocks do not matter), refilled evenly by the time elapsed. One script call charges all of a
request's budgets at once, all or nothing; the same script settles them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from redis.asyncio import Redis

from prefix_gateway.state.redis.connection import RedisClient
from prefix_gateway.state.redis.keys import KeySpace

BUDGET_SCRIPT = """
-- Charge or settle a tenant's budgets per minute, each refilled evenly by Redis's clock.
-- KEYS[i]     budget i's hash: `level`, and `at` (seconds by Redis TIME); absent: full
-- ARGV[1]     'take': take every amount, or none if one does not fit;
--             'give': add every amount (a negative one takes more: the level may go below 0)
-- ARGV[2i]    budget i's limit: a minute's worth (positive)
-- ARGV[2i+1]  budget i's amount
-- Returns     {1 if done else 0, then per budget its level after and the seconds until its
--             amount would fit (0: it does; -1: never, more than the limit)}, as strings
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
local taking = ARGV[1] == 'take'
local levels, waits, fits = {}, {}, true
for index, key in ipairs(KEYS) do
  local limit, amount = tonumber(ARGV[2 * index]), tonumber(ARGV[2 * index + 1])
  local level = limit
  local stored = redis.call('HMGET', key, 'level', 'at')
  if stored[1] and stored[2] then
    local elapsed = math.max(0, now - tonumber(stored[2]))
    level = math.min(limit, tonumber(stored[1]) + elapsed * limit / 60)
  end
  local wait = 0
  if taking and amount > level then
    fits = false
    if amount > limit then wait = -1 else wait = (amount - level) * 60 / limit end
  end
  levels[index], waits[index] = level, wait
end
local reply = {fits and 1 or 0}
for index, key in ipairs(KEYS) do
  local limit, amount = tonumber(ARGV[2 * index]), tonumber(ARGV[2 * index + 1])
  local level = levels[index]
  if fits then
    if taking then level = level - amount else level = math.min(limit, level + amount) end
    redis.call('HSET', key, 'level', string.format('%.17g', level),
      'at', string.format('%.17g', now))
    -- A missing key is a full bucket: a key lives until its bucket is full again (a second
    -- more), so Redis holds nothing for a tenant that stopped.
    redis.call('PEXPIRE', key, math.ceil((limit - level) * 60000 / limit) + 1000)
  end
  reply[#reply + 1] = string.format('%.17g', level)
  reply[#reply + 1] = string.format('%.17g', waits[index])
end
return reply
"""


class BudgetAmount(NamedTuple):
    kind: str
    """`requests` or `tokens`."""
    limit: int
    """The fleet's limit per minute."""
    amount: float


@dataclass(frozen=True, slots=True)
class BudgetReply:
    """What Redis answered for a tenant's budgets, in the order asked."""

    done: bool
    levels: tuple[float, ...]
    waits: tuple[float, ...]
    """0.0 where the amount fits, `math.inf` where it never can."""


class RedisBudgets:
    def __init__(self, client: RedisClient, keys: KeySpace) -> None:
        self._keys = keys
        self._script = cast(Redis, client).register_script(BUDGET_SCRIPT)

    async def take(self, tenant: str, amounts: Sequence[BudgetAmount]) -> BudgetReply:
        """Take every amount from the tenant's budgets, or none if one does not fit."""
        return await self._run(b"take", tenant, amounts)

    async def give(self, tenant: str, amounts: Sequence[BudgetAmount]) -> BudgetReply:
        """Settle: every amount back (a negative one taken, into debt if need be)."""
        return await self._run(b"give", tenant, amounts)

    async def _run(self, mode: bytes, tenant: str, amounts: Sequence[BudgetAmount]) -> BudgetReply:
        keys = [self._keys.budget(tenant, budget.kind) for budget in amounts]
        args: list[bytes | int | str] = [mode]
        for budget in amounts:
            args += [budget.limit, repr(float(budget.amount))]
        reply = await self._script(keys, args)
        numbers = [float(value) for value in reply[1:]]
        return BudgetReply(
            int(reply[0]) == 1,
            tuple(numbers[0::2]),
            tuple(math.inf if wait < 0 else wait for wait in numbers[1::2]),
        )
