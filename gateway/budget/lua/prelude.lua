-- Shared by every script: clock, state, and the reap / grant / finish steps. The scripts get the base as their
-- one key (one argument to encode instead of nine: the encoding is a large part of a call's client cost) and
-- derive the rest; every name carries the base's hash tag, so all of them live in the slot of the declared key.
local base = KEYS[1]
local K_QUEUE, K_TEXP, K_TBYTES = base .. ':queue', base .. ':ticket_expiry', base .. ':ticket_bytes'
local K_LEXP, K_LBYTES, K_USED = base .. ':lease_expiry', base .. ':lease_bytes', base .. ':used'
local K_SEQ, K_GONE, K_META, CHANNEL = base .. ':seq', base .. ':gone', base .. ':meta', base .. ':granted'
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- ARGV[1..3] of every script: the caller's cap, its lease TTL (ms), and the epoch of the budget's record it last
-- saw ('' before its first reply).
local cap = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local known_epoch = ARGV[3]

-- The budget's record: the cap every caller must share, an epoch that names this incarnation of the state, when
-- it was created, and until when nothing is granted. It lives while any caller calls (every process renews at
-- least every TTL / 3), so a cap can change once every process of the old one is gone.
local meta = redis.call('HMGET', K_META, 'cap', 'epoch', 'created', 'settle_until')
if meta[1] and tonumber(meta[1]) ~= cap then
    return {'cap', meta[1]}
end
local epoch, created, settle_until = meta[2], tonumber(meta[3] or '0'), tonumber(meta[4] or '0')
if not epoch then
    -- No record: a new budget, or Redis lost its state (a restart without persistence, a flush, an eviction).
    epoch, created, settle_until = clock[1] .. '.' .. clock[2], now, 0
end
local reassert = known_epoch ~= '' and known_epoch ~= epoch
if reassert then
    -- The caller held state that this incarnation does not have, and so may every other process: nothing is
    -- granted for one lease TTL from the record's creation, in which each live holder re-asserts its leases with
    -- its next renewal (a holder silent for that long has lost them anyway).
    settle_until = math.max(settle_until, created + ttl)
end
if not meta[2] or reassert then
    redis.call('HSET', K_META, 'cap', cap, 'epoch', epoch, 'created', created, 'settle_until', settle_until)
end
redis.call('PEXPIRE', K_META, 3 * ttl)
local settled = now >= settle_until
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
    if not settled then return end
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
    if not settled then best = settle_until - now end
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
    local reply = {used, qlen, next_expiry(), reaped_leases, reaped_tickets, epoch}
    for _, value in ipairs(extra) do reply[#reply + 1] = value end
    return reply
end
