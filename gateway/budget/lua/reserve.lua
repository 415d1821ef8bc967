-- ARGV: cap, ttl_ms, epoch, id, nbytes, max_queued (-1: unbounded). Status 1 granted, 0 queued, -1 queue full, -2 the id
-- was abandoned before this call arrived. A repeated call with the same id answers the id's state.
local id, n, max_queued = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
reap()
grant()
local status
if redis.call('ZSCORE', K_LEXP, id) then
    status = 1
elseif qlen > 0 and redis.call('ZSCORE', K_QUEUE, id) then
    status = 0
elseif redis.call('ZSCORE', K_GONE, id) then
    status = -2
elseif settled and qlen == 0 and used + n <= cap then
    take(id, n)
    status = 1
elseif max_queued >= 0 and qlen >= max_queued then
    status = -1
else
    enqueue(id, n)
    status = 0
end
return finish({status})
