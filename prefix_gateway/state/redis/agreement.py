"""The fleet's agreement in Redis (docs/redis.md, fleet agreement): claims of shared prompts,
set with `SET NX PX` by the gateway that sent one to a backend first, each shared prompt's
decaying count of recent requests, and the backends where a stream computes it now (a hash of
backend to the Redis time its entry lapses), all read in one script call beside the index
lookup.
"""

from __future__ import annotations

import math
from typing import cast

from redis.asyncio import Redis

from prefix_gateway.clock import Clock
from prefix_gateway.state.agreement import FleetView, SharedPrompt
from prefix_gateway.state.redis.connection import RedisClient, RedisLink, RedisUnavailable
from prefix_gateway.state.redis.index import wall_clock
from prefix_gateway.state.redis.keys import KeySpace

AGREE_SCRIPT = """
-- The fleet's view of one request: who claimed its shared prompt, the prompt's count, and
-- the backends where a stream computes it now.
-- KEYS[1]  the claim key of the request's shared prompt
-- KEYS[2]  the count key of its shared prompt, in KEYS[1]'s slot
-- KEYS[3]  the prefills key of its shared prompt, in KEYS[1]'s slot
-- ARGV[1]  now (unix ms, the gateway's clock)
-- ARGV[2]  decay per ms (ln 2 / half-life in ms)
-- ARGV[3]  1: count this request in the prompt's count; 0: only read it
-- ARGV[4]  ms an untouched count key lives
-- ARGV[5]  1: read (and count in) the count; 0: leave it
-- ARGV[6]  1: read the prefills; 0: leave them
-- Returns  {claimant or nil, decayed count (a string) or nil, {backend, ...}}
local claimed = redis.call('GET', KEYS[1])
local computing = {}
if ARGV[6] == '1' then
  local entries = redis.call('HGETALL', KEYS[3])
  if #entries > 0 then
    local time = redis.call('TIME')
    local ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
    for i = 1, #entries, 2 do
      if tonumber(entries[i + 1]) > ms then
        computing[#computing + 1] = entries[i]
      end
    end
  end
end
local count = false
if ARGV[5] == '1' then
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
return {claimed, count, computing}
"""

PREFILL_SCRIPT = """
-- A stream computes a shared prompt on a backend from now, for at most ARGV[2] ms.
-- KEYS[1]  the prefills key of the shared prompt
-- ARGV[1]  the backend
-- ARGV[2]  ms the entry lives at most (what a request waits for it at most)
local time = redis.call('TIME')
local ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], ms + tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

COMPUTING_SCRIPT = """
-- Whether a stream still computes a shared prompt on a backend: 1 or 0.
-- KEYS[1]  the prefills key of the shared prompt
-- ARGV[1]  the backend
local lapses = redis.call('HGET', KEYS[1], ARGV[1])
if not lapses then
  return 0
end
local time = redis.call('TIME')
local ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
if tonumber(lapses) > ms then
  return 1
end
return 0
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
        prefill_wait: float = 0.0,
    ) -> None:
        """`prefill_wait`: what a request waits for a prefill in progress at most, and so how
        long an entry of one lives (0: none are kept)."""
        self._client = client
        self._keys = keys
        self._claim_ms = max(1, round(claim_ttl * 1000))
        self._prefill_ms = max(0, round(prefill_wait * 1000))
        self._rate = math.log(2) / (half_life * 1000)
        self._count_ms = max(1, round(half_life * 1000 * _COUNT_HALF_LIVES))
        self._clock = clock
        scripts = cast(Redis, client)
        self._agree = scripts.register_script(AGREE_SCRIPT)
        self._started = scripts.register_script(PREFILL_SCRIPT)
        self._computing = scripts.register_script(COMPUTING_SCRIPT)

    async def consult(
        self, model: str, first_block: int, claim_key: int, prompt_key: int | None, count: bool
    ) -> FleetView:
        prefix = self._keys.block_prefix(model, first_block)
        keys = [
            self._keys.claim(prefix, claim_key),
            self._keys.prompt_count(prefix, prompt_key or claim_key),
            self._keys.prefills(prefix, claim_key),
        ]
        now = round(self._clock() * 1000)
        flags = [1 if prompt_key is not None else 0, 1 if self._prefill_ms else 0]
        claimed, counted, computing = await self._agree(
            keys, [now, repr(self._rate), 1 if count else 0, self._count_ms, *flags]
        )
        return FleetView(
            claimed.decode() if claimed else None,
            float(counted) if counted is not None else None,
            frozenset(name.decode() for name in computing),
        )

    def _prefills_key(self, prompt: SharedPrompt) -> bytes:
        prefix = self._keys.block_prefix(prompt.model, prompt.first_block)
        return self._keys.prefills(prefix, prompt.key)

    async def started(self, prompt: SharedPrompt, backend: str) -> None:
        await self._started([self._prefills_key(prompt)], [backend, self._prefill_ms])

    async def done(self, prompt: SharedPrompt, backend: str) -> None:
        # redis-py types hdel's name as str; a bytes key is sent as is.
        await self._client.hdel(self._prefills_key(prompt), backend)  # type: ignore[arg-type,misc]

    async def computing(self, prompt: SharedPrompt, backend: str) -> bool:
        return bool(await self._computing([self._prefills_key(prompt)], [backend]))

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

    def started(self, prompt: SharedPrompt, backend: str) -> None:
        self._link.submit("prefill", lambda: self.shared.started(prompt, backend))

    def done(self, prompt: SharedPrompt, backend: str) -> None:
        self._link.submit("prefill", lambda: self.shared.done(prompt, backend))

    async def computing(self, prompt: SharedPrompt, backend: str) -> bool:
        try:
            return await self._link.call("prefill", lambda: self.shared.computing(prompt, backend))
        except RedisUnavailable:
            self._link.fell_back("prefill")
            return False
