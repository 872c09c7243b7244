-- Register a member, replacing the member with the same (role, replica, rank) key in its job.
-- Atomic: the index, the record and the job set change together; the replaced member's record
-- is deleted in the same step; the job's last-used version is raised to the version the
-- member holds (after a store lost its state, the next refit still goes above every version
-- a member holds). Returns the replaced member id ('' when none).
-- ARGV: prefix, job, member key, member id, member JSON, version the member holds
local prefix, job, mkey, id, doc = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local held = tonumber(ARGV[6] or '0')
local jobkey = prefix .. 'job:' .. job
if held > tonumber(redis.call('HGET', jobkey, 'last_version') or '0') then
  redis.call('HSET', jobkey, 'last_version', string.format('%.0f', held))
end
local index = prefix .. 'job:' .. job .. ':members'
local old = redis.call('HGET', index, mkey)
if old and old ~= id then
  redis.call('DEL', prefix .. 'member:' .. old)
else
  old = ''
end
redis.call('HSET', index, mkey, id)
redis.call('SET', prefix .. 'member:' .. id, doc)
redis.call('SADD', prefix .. 'jobs', job)
return old
