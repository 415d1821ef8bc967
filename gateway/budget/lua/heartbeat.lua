-- ARGV: cap, ttl_ms, number of lease ids, lease ids..., ticket ids... Renews the leases and refreshes the tickets
-- that still exist (before reaping, so a holder that was late but not yet reaped keeps its lease), then answers
-- the number renewed, the lease ids Redis no longer has, and the tickets granted and the tickets gone.
local nleases = tonumber(ARGV[3])
local renewed, lost, mine_granted, missing = 0, {}, {}, {}
for i = 4, 3 + nleases do
    local id = ARGV[i]
    if redis.call('ZADD', K_LEXP, 'XX', 'CH', now + ttl, id) == 1 or redis.call('ZSCORE', K_LEXP, id) then
        renewed = renewed + 1
    else
        lost[#lost + 1] = id
    end
end
for i = 4 + nleases, #ARGV do
    redis.call('ZADD', K_TEXP, 'XX', now + ttl, ARGV[i])
end
reap()
reap_tombstones()
grant()
for i = 4 + nleases, #ARGV do
    local id = ARGV[i]
    if redis.call('ZSCORE', K_LEXP, id) then
        redis.call('ZADD', K_LEXP, 'XX', now + ttl, id)
        mine_granted[#mine_granted + 1] = id
    elseif not redis.call('ZSCORE', K_QUEUE, id) then
        missing[#missing + 1] = id
    end
end
return finish({renewed, lost, mine_granted, missing})
