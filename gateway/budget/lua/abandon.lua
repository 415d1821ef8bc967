#!lua flags=allow-oom
-- ARGV: cap, ttl_ms, epoch, window_s, max_tenants, id, tombstone_ms. Takes the id out of the queue, or gives back the
-- lease it was granted and nobody took, and leaves a tombstone so that a reserve call with that id arriving later
-- does nothing. Answers the state (1 left the queue, 2 gave a grant back, 0 unknown), the bytes its tenant holds,
-- and 1 when the id waited behind its tenant's own cap (else 0). It frees more than its tombstone takes, so it runs
-- when Redis is past its maxmemory too.
local id = ARGV[6]
local state, in_use, capped = 0, 0, 0
if redis.call('ZSCORE', K_QUEUE, id) then
    local record = redis.call('HGET', K_TICKETS, id)
    if record then
        local n, _, _, own_cap, _, _, tenant = parse_ticket(record)
        in_use = tenant_state(tenant)
        if own_cap >= 0 and in_use + n > own_cap then capped = 1 end
    end
    drop_ticket(id, false)
    state = 1
elseif drop_lease(id, false) >= 0 then
    state = 2
end
redis.call('ZADD', K_GONE, now + tonumber(ARGV[7]), id)
reap()
grant()
return finish({state, in_use, capped})
