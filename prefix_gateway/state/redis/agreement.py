"""The fleet's agreement in Redis (docs/redis.md, fleet agreement): claims of shared prompts,
set with `SET NX PX` by the gateway that sent one to a backend first, and each shared prompt's
decaying count of recent requests, both read in one script call beside the index lookup.
"""

from __future__ import annotations

import math
from typing import cast

from redis.asyncio import Redis

from prefix_gateway.clock import Clock
from prefix_gateway.state.agreement import FleetView
from prefix_gateway.state.redis.connection import RedisClient, RedisLink, RedisUnavailable
from prefix_gateway.state.redis.index import wall_clock
from prefix_gateway.state.redis.keys import KeySpace

AGREE_SCRIPT = """
-- The fleet's view of one request: who claimed its shared prompt, and the prompt's count.
-- KEYS[1]  the claim key of the request's shared prompt
-- KEYS[2]  (optional) the count key of its shared prompt, in KEYS[1]'s slot
-- ARGV[1]  now (unix ms, the gateway's clock)
-- ARGV[2]  decay per ms (ln 2 / half-life in ms)
-- ARGV[3]  1: count this request in the prompt's count; 0: only read it
-- ARGV[4]  ms an untouched count key lives
-- Returns  {claimant or nil, decayed count (a string) or nil}
local claimed = redis.call('GET', KEYS[1])
local count = false
if KEYS[2] then
  local now, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
  local current = 0
  local value = redis.call('GET', KEYS[2])
  if value then
    local stored, stamp = string.match(value, '^(%S+) (%d+)$')
    if stored then
      current = tonumber(stored) * math.exp(rate * (math.min(tonumber(stamp), now) - now))
    end
  end
  if ARGV[3] == '1' then
    current = current + 1
    redis.call('SET', KEYS[2], string.format('%.4f %d', current, now), 'PX', ARGV[4])
  end
  count = string.format('%.4f', current)
end
return {claimed, count}
"""

# A shared prompt's count lives this many half-lives untouched (by then it is below 0.1%).
_COUNT_HALF_LIVES = 10


class RedisAgreement:
    def __init__(
        self,
        client: RedisClient,
        keys: KeySpace,
        claim_ttl: float,
        half_life: float,
        clock: Clock = wall_clock,
    ) -> None:
        self._client = client
        self._keys = keys
        self._claim_ms = max(1, round(claim_ttl * 1000))
        self._rate = math.log(2) / (half_life * 1000)
        self._count_ms = max(1, round(half_life * 1000 * _COUNT_HALF_LIVES))
        self._clock = clock
        self._agree = cast(Redis, client).register_script(AGREE_SCRIPT)

    async def consult(
        self, model: str, first_block: int, claim_key: int, prompt_key: int | None, count: bool
    ) -> FleetView:
        prefix = self._keys.block_prefix(model, first_block)
        keys = [self._keys.claim(prefix, claim_key)]
        if prompt_key is not None:
            keys.append(self._keys.prompt_count(prefix, prompt_key))
        now = round(self._clock() * 1000)
        claimed, counted = await self._agree(
            keys, [now, repr(self._rate), 1 if count else 0, self._count_ms]
        )
        return FleetView(
            claimed.decode() if claimed else None,
            float(counted) if counted is not None else None,
        )

    async def claim(self, model: str, first_block: int, claim_key: int, backend: str) -> None:
        key = self._keys.claim(self._keys.block_prefix(model, first_block), claim_key)
        await self._client.set(key, backend, nx=True, px=self._claim_ms)


class FallbackAgreement:
    """The agreement while Redis answers; nothing to agree on (local inputs) while it does not."""

    def __init__(self, shared: RedisAgreement, link: RedisLink) -> None:
        self.shared = shared
        self._link = link

    async def consult(
        self, model: str, first_block: int, claim_key: int, prompt_key: int | None, count: bool
    ) -> FleetView | None:
        try:
            return await self._link.call(
                "agree",
                lambda: self.shared.consult(model, first_block, claim_key, prompt_key, count),
            )
        except RedisUnavailable:
            self._link.fell_back("agree")
            return None

    def claim(self, model: str, first_block: int, claim_key: int, backend: str) -> None:
        self._link.submit(
            "claim", lambda: self.shared.claim(model, first_block, claim_key, backend)
        )
