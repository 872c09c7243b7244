-- Forget an idle job: take it out of the job set, so no coordinator drives it again, but only
-- if it has no member and no refit running or pending — checked in the same atomic step, so a
-- member registering at the same moment keeps its job listed. The job hash stays: its version
-- counters keep versions from ever going backwards should the job come back.
-- ARGV: prefix, job
-- Returns 1 when forgotten, 0 when the job is in use.
local prefix, job = ARGV[1], ARGV[2]
local jobkey = prefix .. 'job:' .. job
if redis.call('HLEN', jobkey .. ':members') > 0 then return 0 end
local active = redis.call('HGET', jobkey, 'active') or ''
local pending = redis.call('HGET', jobkey, 'pending') or ''
if active ~= '' or pending ~= '' then return 0 end
redis.call('SREM', prefix .. 'jobs', job)
return 1
