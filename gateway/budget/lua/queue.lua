-- Leases, tickets and grants: the reap / grant / finish steps every script shares.

local function drop_lease(id, released)
    local record = redis.call('HGET', K_LEASES, id)
    if not record then return -1 end
    redis.call('HDEL', K_LEASES, id)
    redis.call('ZREM', K_LEXP, id)
    local n, seconds, micros, tenant = string.match(record, '^(%S+) (%S+) (%S+) (.*)$')
    n = tonumber(n)
    used = used - n
    if released and qlen > 0 then
        -- A class's expected hold prices its requests, which happens while tickets wait: it follows the releases
        -- made then.
        local label = select(4, tenant_state(tenant))
        if label and label ~= '' then
            local held_ms = now - (tonumber(seconds) * 1000 + math.floor(tonumber(micros) / 1000))
            fair_queue().held(label, math.max(held_ms, 0))
        end
    end
    discharge(tenant, n)
    return n
end

local function drop_ticket(id, granting)
    -- Takes the ticket out of the queue: its tenant's next one becomes its head when it was the head; a tenant
    -- that leaves the queue without a grant may be idle.
    local seq = redis.call('ZSCORE', K_QUEUE, id)
    qlen = qlen - redis.call('ZREM', K_QUEUE, id)
    redis.call('ZREM', K_TEXP, id)
    local record = redis.call('HGET', K_TICKETS, id)
    if record then
        redis.call('HDEL', K_TICKETS, id)
        local _, band, _, _, _, label, tenant = parse_ticket(record)
        redis.call('ZREM', queue_key(band, tenant), id)
        if seq and redis.call('HEXISTS', K_STARTS, id) == 1 then
            fair_queue().head_left(band, label, tenant, id, tonumber(seq))
        end
        if not granting then fair_queue().left_queue(tenant) end
    end
end

local function reap()
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_LEXP, '-inf', now)) do
        drop_lease(id, false)
        redis.call('ZREM', K_LEXP, id)
        reaped_leases = reaped_leases + 1
    end
    if qlen > 0 then
        for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_TEXP, '-inf', now)) do
            drop_ticket(id, false)
            reaped_tickets = reaped_tickets + 1
        end
    end
    if used < 0 then used = 0 end
end

local function reap_tombstones()
    redis.call('ZREMRANGEBYSCORE', K_GONE, '-inf', now)
end

local function enqueue(id, n, who, band, label, tenant)
    local weight = select(2, parse_who(who))
    local seq = redis.call('INCR', K_SEQ)
    redis.call('ZADD', K_QUEUE, seq, id)
    redis.call('ZADD', K_TEXP, now + ttl, id)
    redis.call('HSET', K_TICKETS, id, n .. ' ' .. who)
    charge(tenant, 0, label)
    if redis.call('ZADD', queue_key(band, tenant), seq, id) == 1
        and redis.call('ZCARD', queue_key(band, tenant)) == 1 then
        fair_queue().make_head(band, label, weight, tenant, id, n, seq)
    end
    qlen = qlen + 1
end

local function take(id, n, tenant, label)
    redis.call('ZADD', K_LEXP, now + ttl, id)
    redis.call('HSET', K_LEASES, id, n .. ' ' .. now_text .. ' ' .. tenant)
    used = used + n
    charge(tenant, n, label)
end

local function grant()
    -- The interactive band first: while one of its classes has a head within its tenant's cap, the head the fair
    -- queue puts first is granted when it fits, and nothing is granted when it does not (no overtaking, no batch
    -- grant while an interactive head waits for room). Then the batch band, the same way.
    if not settled or qlen == 0 then return end
    local queue = fair_queue()
    for _, band in ipairs(BANDS) do
        while true do
            local head, class = queue.next_head(band)
            if not head then break end
            if used + head.n > cap then return end
            queue.moved(band, class, head)
            drop_ticket(head.id, true)
            take(head.id, head.n, head.tenant, head.label)
            queue.restart(band, class)
            granted[#granted + 1] = head.id
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
    -- The reply: the cluster's bytes in use and waiting tickets, when the earliest lease or ticket expires, the
    -- leases and tickets this call reaped, the epoch, the tenant records (-1: not counted, but by the heartbeat and
    -- the snapshot) and those this call evicted; then the script's own answers.
    if fair then fair.save() end
    if used ~= used_before then redis.call('SET', K_USED, used) end
    if #granted > 0 then
        redis.call('PUBLISH', CHANNEL, table.concat(granted, ' '))
    end
    local reply = {used, qlen, next_expiry(), reaped_leases, reaped_tickets, epoch,
        count_tenants and redis.call('HLEN', K_TENANTS) or -1, evicted}
    for _, value in ipairs(extra) do reply[#reply + 1] = value end
    return reply
end
