"""The Lua scripts of the shared prefix index, registered once per client (docs/redis.md).

Every block key of a prompt shares KEYS[1]'s hash tag; the scripts build the names from a key
prefix and the packed hashes. Stamps are prefix-closed, so both binary-search the chain: a
lookup reads O(log n) blocks per distinct depth, a write rewrites only blocks whose stamp is
behind. Over holes (an evicted middle key, a partial `forget`) a lookup answers a depth
between a walk from the root's and the deepest counting entry's.
"""

from __future__ import annotations

# Blocks fetched per MGET: bounded so that `unpack` stays far below Lua's stack limit.
_CHUNK = 256

_BLOCK_KEYS = f"""
local function block_keys(names, width, first, last)
  local keys = {{}}
  for position = first, last do
    keys[#keys + 1] = string.sub(names, (position - 1) * width + 1, position * width)
  end
  return keys
end
local CHUNK = {_CHUNK}
"""

# The key of block `position` (from 1) of a prompt: its prefix and its packed 8-byte hash.
_PACKED_KEYS = f"""
local CHUNK = {_CHUNK}
local prefix, hashes = ARGV[1], ARGV[2]
local blocks = #hashes / 8
local function block_key(position)
  return prefix .. string.sub(hashes, position * 8 - 7, position * 8)
end
"""

MATCH_SCRIPT = (
    """
-- Matched depth per backend along one prompt's block chain.
-- KEYS[1]  the key of the prompt's first block (it names the slot of every block key)
-- ARGV[1]  what every block key of the prompt begins with (namespace and hash tag)
-- ARGV[2]  the prompt's block hashes in chain order, 8 bytes each
-- ARGV[3]  oldest stamp (unix ms) that still counts
-- Returns  a flat array: backend, depth, backend, depth, ...
"""
    + _PACKED_KEYS
    + """
local oldest = tonumber(ARGV[3])
-- position -> {backend -> stamp}; backends of equal depth share every probe.
local read = {}
local function stamps_at(position)
  local stamps = read[position]
  if stamps == nil then
    stamps = {}
    local value = redis.call('GET', block_key(position))
    if value then
      for backend, stamp in string.gmatch(value, '([^ \\n]+) (%d+)\\n') do
        stamps[backend] = tonumber(stamp)
      end
    end
    read[position] = stamps
  end
  return stamps
end
local result = {}
for backend, stamp in pairs(stamps_at(1)) do
  if stamp >= oldest then
    -- Block `low` is fresh for this backend; find the deepest such block.
    local low, high = 1, blocks
    while low < high do
      local middle = math.floor((low + high + 1) / 2)
      local probe = stamps_at(middle)[backend]
      if probe ~= nil and probe >= oldest then low = middle else high = middle - 1 end
    end
    result[#result + 1] = backend
    result[#result + 1] = low
  end
end
return result
"""
)

RECORD_SCRIPT = (
    """
-- Remember that a backend was sent every block of one prompt.
-- KEYS[1]  the key of the prompt's first block (it names the slot of every block key)
-- ARGV[1]  what every block key of the prompt begins with (namespace and hash tag)
-- ARGV[2]  the prompt's block hashes in chain order, 8 bytes each
-- ARGV[3]  backend name (no spaces or newlines)
-- ARGV[4]  this write's stamp: now rounded down to the refresh period (unix ms)
-- ARGV[5]  oldest stamp that still counts; older entries are dropped
-- ARGV[6]  how long a key outlives the newest stamp in it (ms): longer than an entry counts
-- ARGV[7]  now (unix ms, the gateway's clock: key TTLs are durations from it)
-- ARGV[8]  the most a key expires early for its depth (ms): at most ARGV[6] minus the TTL
-- Returns  the number of block keys written
"""
    + _PACKED_KEYS
    + """
local backend, stamp, oldest = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local lifetime, now, stagger = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local function own_stamp(value)
  if value then
    for name, entry in string.gmatch(value, '([^ \\n]+) (%d+)\\n') do
      if name == backend then return tonumber(entry) end
    end
  end
  return -1
end
-- Blocks 1..low already carry this stamp (or a newer one): prefix-closed stamps. The first
-- block is read apart: were it evicted while deeper blocks stayed, the search would skip it
-- and leave the whole chain unmatchable until the next period.
local low, high = 1, blocks
if own_stamp(redis.call('GET', block_key(1))) < stamp then low, high = 0, 0 end
while low < high do
  local middle = math.floor((low + high + 1) / 2)
  if own_stamp(redis.call('GET', block_key(middle))) >= stamp then
    low = middle
  else
    high = middle - 1
  end
end
-- The new value (this backend stamped, entries past the TTL dropped) and its newest stamp.
local function rewrite(value)
  local parts, own, newest = {}, ARGV[4], stamp
  if value then
    for name, entry in string.gmatch(value, '([^ \\n]+) (%d+)\\n') do
      local time = tonumber(entry)
      if name == backend then
        -- Never lower a stamp (a gateway whose clock runs ahead wrote it).
        if time > stamp then own = entry end
      elseif time >= oldest then
        parts[#parts + 1] = name .. ' ' .. entry .. '\\n'
      end
      if time > newest and (name == backend or time >= oldest) then newest = time end
    end
  end
  parts[#parts + 1] = backend .. ' ' .. own .. '\\n'
  return table.concat(parts), newest
end
local written = 0
-- A fresh table equals no MGET value, so the first block is always decoded.
local previous_old, previous_new, newest = {}, false, stamp
for first = low + 1, blocks, CHUNK do
  local last = math.min(first + CHUNK - 1, blocks)
  local keys = {}
  for position = first, last do keys[#keys + 1] = block_key(position) end
  local values = redis.call('MGET', unpack(keys))
  for index = 1, #keys do
    local value = values[index]
    if value ~= previous_old then
      previous_old = value
      previous_new, newest = rewrite(value)
    end
    -- A key expires by its newest stamp, a millisecond earlier per block of depth: stamps
    -- never grow with depth, so `volatile-ttl` evicts a chain from its end, never its root.
    local early = math.min(first + index - 2, stagger)
    redis.call('SET', keys[index], previous_new, 'PX', math.max(1, newest + lifetime - early - now))
    written = written + 1
  end
end
return written
"""
)

FORGET_SCRIPT = (
    """
-- A backend no longer holds these blocks (its cache evicted them).
-- KEYS[1]  the key of the first of these blocks (it names the slot of every block key)
-- ARGV[1]  the block keys to forget, concatenated
-- ARGV[2]  the length of one block key
-- ARGV[3]  backend name
-- Returns  the number of block keys changed
"""
    + _BLOCK_KEYS
    + """
local names, width, backend = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local changed = 0
local keys = block_keys(names, width, 1, #names / width)
for _, key in ipairs(keys) do
  local value = redis.call('GET', key)
  if value then
    local parts, found = {}, false
    for name, stamp in string.gmatch(value, '([^ \\n]+) (%d+)\\n') do
      if name == backend then
        found = true
      else
        parts[#parts + 1] = name .. ' ' .. stamp .. '\\n'
      end
    end
    if found then
      changed = changed + 1
      if #parts == 0 then
        redis.call('DEL', key)
      else
        redis.call('SET', key, table.concat(parts), 'KEEPTTL')
      end
    end
  end
end
return changed
"""
)
