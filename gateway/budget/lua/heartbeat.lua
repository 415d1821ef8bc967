#!lua flags=allow-oom
-- ARGV: cap, ttl_ms, epoch, window_s, max_tenants, number of leases, (lease id, bytes, tenant) per lease..., ticket
-- ids... Renews the leases and refreshes the tickets that still exist (before reaping, so a holder that was late
-- but not yet reaped keeps its lease). A lease Redis no longer has is lost, unless the caller's epoch is an earlier
-- one: then Redis lost it, the request still holds the bytes, and it is re-asserted for its tenant. Sweeps idle
-- tenants' records in proportion to how many there are. Answers the number renewed, the number re-asserted, the
-- lease ids lost, and the tickets granted and the tickets gone. It renews and frees what exists (a re-asserted lease
-- only after Redis lost everything), so it runs when Redis is past its maxmemory too: the sweep that frees memory
-- is never refused.
local nleases = tonumber(ARGV[6])
local last_lease = 6 + 3 * nleases
local renewed, reasserted, lost, mine_granted, missing = 0, 0, {}, {}, {}
for i = 7, last_lease, 3 do
    local id = ARGV[i]
    if redis.call('ZADD', K_LEXP, 'XX', 'CH', now + ttl, id) == 1 or redis.call('ZSCORE', K_LEXP, id) then
        renewed = renewed + 1
    elseif reassert then
        take(id, tonumber(ARGV[i + 1]), ARGV[i + 2])
        reasserted = reasserted + 1
    else
        lost[#lost + 1] = id
    end
end
for i = last_lease + 1, #ARGV do
    redis.call('ZADD', K_TEXP, 'XX', now + ttl, ARGV[i])
end
count_tenants = true
keep_record()
reap()
reap_tombstones()
grant()
local idle = redis.call('ZCARD', K_IDLE)
if idle > 0 then fair_queue().sweep(math.min(SWEEP_MAX, math.max(SWEEP_MIN, math.ceil(idle / SWEEP_SHARE)))) end
for i = last_lease + 1, #ARGV do
    local id = ARGV[i]
    if redis.call('ZSCORE', K_LEXP, id) then
        redis.call('ZADD', K_LEXP, 'XX', now + ttl, id)
        mine_granted[#mine_granted + 1] = id
    elseif not redis.call('ZSCORE', K_QUEUE, id) then
        missing[#missing + 1] = id
    end
end
return finish({renewed, reasserted, lost, mine_granted, missing})
