#!lua
-- ARGV: cap, ttl_ms, epoch, window_s, max_tenants, id, nbytes, max_queued (-1: unbounded), who ('band weight own_cap
-- max_waiting label_length label tenant', -1: no bound). Status 1 granted, 0 queued, -1 queue full, -2 the id was
-- abandoned before this call arrived, -3 the tenant has max_waiting tickets waiting (then also their number). A
-- repeated call with the same id answers the id's state. The one script that may need memory for its own request:
-- no flags, so a Redis past its maxmemory refuses it (OOM) before it runs.
local id, n, max_queued, who = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local band, _, own_cap, max_waiting, label, tenant = parse_who(who)
reap()
grant()
local status, waiting
if redis.call('ZSCORE', K_LEXP, id) then
    status = 1
elseif qlen > 0 and redis.call('ZSCORE', K_QUEUE, id) then
    status = 0
elseif redis.call('ZSCORE', K_GONE, id) then
    status = -2
-- Free, and nobody waits: granted at once, outside the queue, its bounds and the fair clocks (which move only while
-- tickets wait, so a tenant served alone keeps no lead and no record past its leases).
elseif settled and qlen == 0 and used + n <= cap
    and (own_cap < 0 or tenant_state(tenant) + n <= own_cap) then
    take(id, ARGV[7], tenant, label)
    status = 1
elseif max_queued >= 0 and qlen >= max_queued then
    status = -1
else
    if max_waiting >= 0 then waiting = tenant_waiting(tenant) end
    if waiting and waiting >= max_waiting then
        status = -3
    else
        enqueue(id, n, who, band, label, tenant)
        -- Tickets may wait that this one need not wait behind: those of tenants at their own cap.
        grant()
        status = 0
        for i, granted_id in ipairs(granted) do
            if granted_id == id then
                -- Answered here: no message for it.
                table.remove(granted, i)
                status = 1
                break
            end
        end
    end
end
if status == -3 then return finish({status, waiting}) end
return finish({status})
