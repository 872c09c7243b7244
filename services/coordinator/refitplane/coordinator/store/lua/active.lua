-- The job's active refit record (nil when none): the driver's one read per step.
-- ARGV: prefix, job
local prefix, job = ARGV[1], ARGV[2]
local id = redis.call('HGET', prefix .. 'job:' .. job, 'active')
if not id or id == '' then return false end
return redis.call('GET', prefix .. 'refit:' .. id)
