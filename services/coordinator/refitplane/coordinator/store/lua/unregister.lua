-- Remove a member; the (role, replica, rank) index entry goes only if it still points at it
-- (a newer registration under the same key must survive the old member's removal).
-- ARGV: prefix, job, member key, member id
local prefix, job, mkey, id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local index = prefix .. 'job:' .. job .. ':members'
if redis.call('HGET', index, mkey) == id then
  redis.call('HDEL', index, mkey)
end
return redis.call('DEL', prefix .. 'member:' .. id)
