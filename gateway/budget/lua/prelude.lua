-- Shared by every script: clock, state, and the reap / grant / finish steps. The scripts get the base as their
-- one key (one argument to encode instead of nine: the encoding is a large part of a call's client cost) and
-- derive the rest; every name carries the base's hash tag, so all of them live in the slot of the declared key.
local base = KEYS[1]
local K_QUEUE, K_TEXP, K_TBYTES = base .. ':queue', base .. ':ticket_expiry', base .. ':ticket_bytes'
local K_LEXP, K_LBYTES, K_USED = base .. ':lease_expiry', base .. ':lease_bytes', base .. ':used'
local K_SEQ, K_GONE, CHANNEL = base .. ':seq', base .. ':gone', base .. ':granted'
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local cap = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local used = tonumber(redis.call('GET', K_USED) or '0')
local used_before = used
local qlen = redis.call('ZCARD', K_QUEUE)
local reaped_leases, reaped_tickets = 0, 0
local granted = {}

local function drop_lease(id)
    local n = redis.call('HGET', K_LBYTES, id)
    if not n then return -1 end
    redis.call('HDEL', K_LBYTES, id)
    redis.call('ZREM', K_LEXP, id)
    used = used - tonumber(n)
    return tonumber(n)
end

local function drop_ticket(id)
    qlen = qlen - redis.call('ZREM', K_QUEUE, id)
    redis.call('ZREM', K_TEXP, id)
    redis.call('HDEL', K_TBYTES, id)
end

local function reap()
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_LEXP, '-inf', now)) do
        drop_lease(id)
        redis.call('ZREM', K_LEXP, id)
        reaped_leases = reaped_leases + 1
    end
    if qlen > 0 then
        for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_TEXP, '-inf', now)) do
            drop_ticket(id)
            reaped_tickets = reaped_tickets + 1
        end
    end
    if used < 0 then used = 0 end
end

local function reap_tombstones()
    redis.call('ZREMRANGEBYSCORE', K_GONE, '-inf', now)
end

local function enqueue(id, n)
    redis.call('ZADD', K_QUEUE, redis.call('INCR', K_SEQ), id)
    redis.call('ZADD', K_TEXP, now + ttl, id)
    redis.call('HSET', K_TBYTES, id, n)
    qlen = qlen + 1
end

local function take(id, n)
    redis.call('ZADD', K_LEXP, now + ttl, id)
    redis.call('HSET', K_LBYTES, id, n)
    used = used + n
end

local function grant()
    while qlen > 0 do
        local head = redis.call('ZRANGE', K_QUEUE, 0, 0)[1]
        if not head then break end
        local n = tonumber(redis.call('HGET', K_TBYTES, head) or '-1')
        if n >= 0 and used + n > cap then break end
        drop_ticket(head)
        if n >= 0 then
            take(head, n)
            granted[#granted + 1] = head
        end
    end
end

local function next_expiry()
    -- Only a process with waiters uses it, and then the queue is not empty.
    local best = -1
    if qlen == 0 then return best end
    for _, key in ipairs({K_LEXP, K_TEXP}) do
        local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
        if first[2] then
            local left = tonumber(first[2]) - now
            if left < 0 then left = 0 end
            if best < 0 or left < best then best = left end
        end
    end
    return best
end

local function finish(extra)
    if used ~= used_before then redis.call('SET', K_USED, used) end
    if #granted > 0 then
        redis.call('PUBLISH', CHANNEL, table.concat(granted, ' '))
    end
    local reply = {used, qlen, next_expiry(), reaped_leases, reaped_tickets}
    for _, value in ipairs(extra) do reply[#reply + 1] = value end
    return reply
end
