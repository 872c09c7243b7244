-- Trigger a refit of a job: idempotency, version allocation and coalescing in one step.
--   * a known idempotency key returns the refit it named ('existing');
--   * version 0 means last used + 1; an explicit version must exceed every version used;
--   * no active refit: the new refit becomes active; one active and one pending: the
--     trigger coalesces into the pending one (latest version wins, targets are unioned,
--     empty meaning every replica); otherwise the new refit is queued as pending.
-- Versions stay below 10^14 so Lua numbers and cjson (14 significant digits) stay exact.
-- Nothing is written to a store that lost its state (its incarnation sentinel is not the
-- coordinator's): a wiped store would hand out versions replicas already hold.
-- ARGV: prefix, job, version, target replicas (JSON array), idempotency key, now, new id,
--       key ttl seconds, max version, incarnation
-- Returns {outcome, refit JSON} with outcome created|coalesced|existing, or
--         {'stale', last version} / {'too_large', max version} / {'lost', ''}.
local prefix, job, asked, targets_json, key = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local now, new_id, key_ttl, max_version = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local claimed = ARGV[10]  -- '' when the caller never claimed one (tools, store tests)
if claimed ~= '' and redis.call('GET', prefix .. 'incarnation') ~= claimed then
  return {'lost', ''}
end
local jobkey = prefix .. 'job:' .. job
local function refit_key(id) return prefix .. 'refit:' .. id end
local idem = prefix .. 'idem:' .. job .. ':' .. key

if key ~= '' then
  local existing = redis.call('GET', idem)
  if existing then
    local doc = redis.call('GET', refit_key(existing))
    if doc then return {'existing', doc} end
  end
end

local last = tonumber(redis.call('HGET', jobkey, 'last_version') or '0')
local version = asked
if asked == 0 then version = last + 1 end
if version <= last then return {'stale', string.format('%.0f', last)} end
if version > max_version then return {'too_large', string.format('%.0f', max_version)} end
redis.call('HSET', jobkey, 'last_version', string.format('%.0f', version))

local targets = cjson.decode(targets_json)
local active = redis.call('HGET', jobkey, 'active') or ''
local pending = redis.call('HGET', jobkey, 'pending') or ''
local outcome, id, doc
if active ~= '' and pending ~= '' then
  local rec = cjson.decode(redis.call('GET', refit_key(pending)))
  rec.version = version
  rec.coalesced = (rec.coalesced or 0) + 1
  rec.updated_unix = now
  if #targets == 0 or next(rec.target_replicas) == nil then
    rec.target_replicas = {}
  else
    local seen = {}
    for _, r in ipairs(rec.target_replicas) do seen[r] = true end
    for _, r in ipairs(targets) do
      if not seen[r] then table.insert(rec.target_replicas, r); seen[r] = true end
    end
    table.sort(rec.target_replicas)
  end
  doc = cjson.encode(rec)
  redis.call('SET', refit_key(pending), doc)
  outcome, id = 'coalesced', pending
else
  local rec = {refit_id = new_id, job = job, version = version, state = 'PENDING',
               target_replicas = targets, idempotency_key = key, created_unix = now,
               updated_unix = now, phase_started_unix = now, coalesced = 0}
  doc = cjson.encode(rec)
  redis.call('SET', refit_key(new_id), doc)
  local seq = redis.call('HINCRBY', jobkey, 'seq', 1)
  redis.call('ZADD', jobkey .. ':refits', seq, new_id)
  if active == '' then
    redis.call('HSET', jobkey, 'active', new_id)
  else
    redis.call('HSET', jobkey, 'pending', new_id)
  end
  redis.call('SADD', prefix .. 'jobs', job)
  outcome, id = 'created', new_id
end
if key ~= '' then redis.call('SET', idem, id, 'EX', key_ttl) end
return {outcome, doc}
