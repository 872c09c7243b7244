-- Compare-and-set a refit record: write the new record only if the stored state is one of
-- the expected states. A terminal transition also moves the job's pointers (the pending
-- refit becomes active), raises committed_version on COMMITTED, and trims old records.
-- ARGV: prefix, job, refit id, expected states (comma list), new JSON, terminal (1/0),
--       committed version (0: none), records kept per job, the incarnation the coordinator
--       claimed ('' if none)
-- Returns {'ok', previous state} | {'conflict', current state} | {'missing', ''} |
--         {'lost', ''}: the record is gone because the store lost its state (its
--         incarnation sentinel is not the one claimed), not because the refit is unknown.
local prefix, job, id, expected, doc = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local terminal, committed, keep = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local claimed = ARGV[9] or ''

local jobkey = prefix .. 'job:' .. job
local function refit_key(rid) return prefix .. 'refit:' .. rid end

local cur = redis.call('GET', refit_key(id))
if not cur then
  if claimed ~= '' and redis.call('GET', prefix .. 'incarnation') ~= claimed then
    return {'lost', ''}
  end
  return {'missing', ''}
end
-- The only "state" key of a record is its top-level one (json from pydantic or cjson, no
-- spaces), so a pattern reads it without decoding a record that may list 1000s of ranks.
local state = string.match(cur, '"state":"(%u+)"') or cjson.decode(cur).state
if not string.find(',' .. expected .. ',', ',' .. state .. ',', 1, true) then
  return {'conflict', state}
end
redis.call('SET', refit_key(id), doc)

if terminal == '1' then
  local active = redis.call('HGET', jobkey, 'active') or ''
  local pending = redis.call('HGET', jobkey, 'pending') or ''
  if active == id then
    redis.call('HSET', jobkey, 'active', pending, 'pending', '')
    active, pending = pending, ''
  elseif pending == id then
    redis.call('HSET', jobkey, 'pending', '')
    pending = ''
  end
  if committed > 0 then
    local before = tonumber(redis.call('HGET', jobkey, 'committed_version') or '0')
    if committed > before then
      redis.call('HSET', jobkey, 'committed_version', string.format('%.0f', committed))
    end
  end
  local index = jobkey .. ':refits'
  local n = redis.call('ZCARD', index)
  if n > keep then
    for _, old in ipairs(redis.call('ZRANGE', index, 0, n - keep - 1)) do
      if old ~= active and old ~= pending then
        redis.call('DEL', refit_key(old))
        redis.call('ZREM', index, old)
      end
    end
  end
end
return {'ok', state}
