-- Upsert a member's record: write it and index it under its key, unless another member holds
-- the key (this one was replaced; its record is not written). A store that lost its state gets
-- the member back whole (the old SET ... XX wrote nothing there).
-- ARGV: prefix, job, member key, member id, member JSON
local prefix, job, mkey, id, doc = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local index = prefix .. 'job:' .. job .. ':members'
local holder = redis.call('HGET', index, mkey)
if holder and holder ~= id then return 0 end
redis.call('HSET', index, mkey, id)
redis.call('SET', prefix .. 'member:' .. id, doc)
redis.call('SADD', prefix .. 'jobs', job)
return 1
