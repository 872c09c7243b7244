-- Re-seed a job's versions after the store lost its state: raise last_version and
-- committed_version to at least the given values (never lower), list the job.
-- ARGV: prefix, job, last version, committed version
local prefix, job = ARGV[1], ARGV[2]
local jobkey = prefix .. 'job:' .. job
local fields = {last_version = tonumber(ARGV[3]), committed_version = tonumber(ARGV[4])}
for name, floor in pairs(fields) do
  if floor > tonumber(redis.call('HGET', jobkey, name) or '0') then
    redis.call('HSET', jobkey, name, string.format('%.0f', floor))
  end
end
redis.call('SADD', prefix .. 'jobs', job)
return 1
