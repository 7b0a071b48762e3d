"""The Lua scripts of the shared prefix index, registered once per client.

One block of a prompt is one string key (see `keys.py`) whose value lists every backend that
was sent the block, with the time it was last sent there: `"<backend> <unix ms>\\n"` per
backend. All block keys of one prompt share the hash tag of KEYS[1], the prompt's first block,
so every key a script touches lives in that key's slot — which is why the scripts take the
other block keys as one string of fixed-width names in ARGV instead of declaring each: a
32k-token prompt would otherwise be 2,000 separate arguments per call, and encoding them cost
more than the lookup itself. Redis Cluster still checks that every key a script touches is in
the declared key's slot (and errors if not), so a mistake here is loud, never silent.

Consecutive blocks recorded together hold byte-identical values, and Lua compares interned
strings in O(1): the scripts decode a value only where it differs from the previous block's,
so a conversation's history of hundreds of blocks costs one MGET and a few decodes.
"""

from __future__ import annotations

# Blocks fetched per MGET: bounded so that `unpack` stays far below Lua's stack limit and a
# lookup that stops early has fetched little past its end.
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

MATCH_SCRIPT = (
    """
-- Matched depth per backend along one prompt's block chain.
-- KEYS[1]  the key of the prompt's first block (it names the slot of every block key)
-- ARGV[1]  the block keys of the prompt in chain order, concatenated
-- ARGV[2]  the length of one block key
-- ARGV[3]  oldest last-sent time (unix ms) that still counts
-- Returns  a flat array: backend, depth, backend, depth, ...
"""
    + _BLOCK_KEYS
    + """
local names, width, oldest = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local blocks = #names / width
local depth_of, order = {}, {}
local extending, in_run = {}, {}
local previous = false
local reached = 0
local stopped = false
for first = 1, blocks, CHUNK do
  local last = math.min(first + CHUNK - 1, blocks)
  local values = redis.call('MGET', unpack(block_keys(names, width, first, last)))
  for index = 1, #values do
    local value = values[index]
    local position = first + index - 1
    if not value then stopped = true break end
    if value ~= previous then
      -- A backend extends here if it is fresh and extended every block before this one.
      local next_extending, next_in_run = {}, {}
      for backend, stamp in string.gmatch(value, '([^ \\n]+) (%d+)\\n') do
        if tonumber(stamp) >= oldest and (position == 1 or in_run[backend]) then
          next_extending[#next_extending + 1] = backend
          next_in_run[backend] = true
        end
      end
      if #next_extending == 0 then stopped = true break end
      for _, backend in ipairs(extending) do depth_of[backend] = position - 1 end
      for _, backend in ipairs(next_extending) do
        if depth_of[backend] == nil then order[#order + 1] = backend end
      end
      extending, in_run, previous = next_extending, next_in_run, value
    end
    reached = position
  end
  if stopped then break end
end
for _, backend in ipairs(extending) do depth_of[backend] = reached end
local result = {}
for _, backend in ipairs(order) do
  result[#result + 1] = backend
  result[#result + 1] = depth_of[backend]
end
return result
"""
)

RECORD_SCRIPT = (
    """
-- Remember that a backend was sent every block of one prompt.
-- KEYS[1]  the key of the prompt's first block (it names the slot of every block key)
-- ARGV[1]  the block keys of the prompt in chain order, concatenated
-- ARGV[2]  the length of one block key
-- ARGV[3]  backend name (no spaces or newlines)
-- ARGV[4]  now (unix ms)
-- ARGV[5]  oldest last-sent time (unix ms) that still counts; older entries are dropped
-- ARGV[6]  the key TTL (ms), restarted on every block written
-- ARGV[7]  an entry sent at or after this time (unix ms) is fresh enough to leave alone
-- Returns  the number of block keys written
"""
    + _BLOCK_KEYS
    + """
local names, width, backend, now = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local oldest, ttl, recent = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local blocks = #names / width
local written = 0
-- A fresh table equals no MGET value, so the first block is always decoded.
local previous_old, previous_new = {}, false
local function rewrite(value)
  local parts = {}
  if value then
    for name, stamp in string.gmatch(value, '([^ \\n]+) (%d+)\\n') do
      if name == backend then
        if tonumber(stamp) >= recent then return false end
      elseif tonumber(stamp) >= oldest then
        parts[#parts + 1] = name .. ' ' .. stamp .. '\\n'
      end
    end
  end
  parts[#parts + 1] = backend .. ' ' .. now .. '\\n'
  return table.concat(parts)
end
for first = 1, blocks, CHUNK do
  local last = math.min(first + CHUNK - 1, blocks)
  local keys = block_keys(names, width, first, last)
  local values = redis.call('MGET', unpack(keys))
  for index = 1, #keys do
    local value = values[index]
    if value ~= previous_old then
      previous_old, previous_new = value, rewrite(value)
    end
    if previous_new then
      redis.call('SET', keys[index], previous_new, 'PX', ttl)
      written = written + 1
    end
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
