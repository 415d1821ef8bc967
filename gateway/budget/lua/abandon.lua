-- ARGV: cap, ttl_ms, epoch, id, tombstone_ms. Takes the id out of the queue, or gives back the lease it was granted and
-- nobody took, and leaves a tombstone so that a reserve call with that id arriving later does nothing.
-- State 1 left the queue, 2 gave a grant back, 0 unknown.
local id = ARGV[4]
local state = 0
if redis.call('ZSCORE', K_QUEUE, id) then
    drop_ticket(id)
    state = 1
elseif drop_lease(id) >= 0 then
    state = 2
end
redis.call('ZADD', K_GONE, now + tonumber(ARGV[5]), id)
reap()
grant()
return finish({state})
