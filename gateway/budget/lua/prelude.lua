-- Shared by every script: clock, state, and the reap / grant / finish steps. The scripts get the base as their
-- one key (one argument to encode instead of one a name: the encoding is a large part of a call's client cost)
-- and derive the rest; every name starts with the base and its hash tag, so all of them live in the slot of the
-- declared key, whatever follows the tag (a tenant's id).
local base = KEYS[1]
local K_QUEUE, K_TEXP, K_TICKETS = base .. ':queue', base .. ':ticket_expiry', base .. ':tickets'
local K_LEXP, K_LEASES, K_USED = base .. ':lease_expiry', base .. ':leases', base .. ':used'
local K_TENANTS = base .. ':tenants'
local K_SEQ, K_GONE, K_META, CHANNEL = base .. ':seq', base .. ':gone', base .. ':meta', base .. ':granted'
-- The bands, interactive first, and the set of tenants with tickets in each.
local BANDS = {'0', '1'}
local K_WAITING = {['0'] = base .. ':waiting:0', ['1'] = base .. ':waiting:1'}
-- As the local backend: the expected hold before the first release (ms), the weight of each release in its
-- average, and the decayed service (byte-seconds) below which an idle tenant's record is dropped.
local INITIAL_HOLD_MS, HOLD_EWMA, FORGET_BELOW = 1000, 0.05, 1.0
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- `now` as a lease's record writes it: seconds and microseconds, as TIME answers them (no number to format).
local now_text = clock[1] .. ' ' .. clock[2]
-- ARGV[1..4] of every script: the caller's cap, its lease TTL (ms), the epoch of the budget's record it last
-- saw ('' before its first reply), and the time constant of the tenants' service (s).
local cap = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local known_epoch = ARGV[3]
local window_s = tonumber(ARGV[4])

-- The budget's record: the cap every caller must share, an epoch that names this incarnation of the state, when
-- it was created, until when nothing is granted, the expected hold of a grant (ms) and where the sweep of idle
-- tenants goes on. It lives three TTLs from its creation and from each heartbeat (every process sends one every
-- TTL / 3), so a cap can change once every process of the old one is gone.
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
local function keep_record()
    redis.call('PEXPIRE', K_META, 3 * ttl)
end
if not meta[2] or reassert then
    redis.call('HSET', K_META, 'cap', cap, 'epoch', epoch, 'created', created, 'settle_until', settle_until)
    keep_record()
end
local settled = now >= settle_until
-- Read when first needed: only grants (and the releases while tickets wait) use it.
local hold_ms, hold_changed = nil, false
local function expected_hold_ms()
    if not hold_ms then hold_ms = tonumber(redis.call('HGET', K_META, 'hold') or INITIAL_HOLD_MS) end
    return hold_ms
end
local used = tonumber(redis.call('GET', K_USED) or '0')
local used_before = used
local qlen = redis.call('ZCARD', K_QUEUE)
local reaped_leases, reaped_tickets = 0, 0
local granted = {}

-- A tenant: its record in K_TENANTS is three little-endian doubles (struct '<ddd', the cheapest record to read and
-- write): the bytes its leases hold, its decayed byte-seconds, the time (ms) they are settled to; its tickets of
-- each band wait in the sorted set queue_key(band, tenant) by arrival.
local function queue_key(band, tenant)
    return base .. ':q:' .. band .. ':' .. tenant
end

local function tenant_state(tenant)
    local record = redis.call('HGET', K_TENANTS, tenant)
    if not record then return 0, 0, now end
    local in_use, service, stamp = struct.unpack('<ddd', record)
    return in_use, service, stamp
end

local function settled_service(in_use, service, stamp)
    -- dS/dt = in_use - S / window, exactly, in_use being constant since stamp.
    local elapsed = (now - stamp) / 1000
    if elapsed <= 0 then return service end
    local decay = math.exp(-elapsed / window_s)
    return service * decay + in_use * window_s * (1 - decay)
end

local function charge(tenant, delta)
    local in_use, service, stamp = tenant_state(tenant)
    service = settled_service(in_use, service, stamp)
    if now > stamp then stamp = now end
    in_use = in_use + delta
    if in_use < 0 then in_use = 0 end
    redis.call('HSET', K_TENANTS, tenant, struct.pack('<ddd', in_use, service, stamp))
end

-- What a reserve call says of its tenant and band: 'band weight own_cap max_waiting tenant' (-1: no bound). A
-- ticket's record in K_TICKETS is its bytes and that; a lease's in K_LEASES 'bytes seconds microseconds tenant'
-- (when it was granted, as TIME answered).
local function parse_who(who)
    local band, weight, own_cap, max_waiting, tenant = string.match(who, '^(%S+) (%S+) (%S+) (%S+) (.*)$')
    return band, tonumber(weight), tonumber(own_cap), tonumber(max_waiting), tenant
end

local function parse_ticket(record)
    local n, who = string.match(record, '^(%S+) (.*)$')
    return tonumber(n), parse_who(who)
end

local function drop_lease(id, released)
    local record = redis.call('HGET', K_LEASES, id)
    if not record then return -1 end
    redis.call('HDEL', K_LEASES, id)
    redis.call('ZREM', K_LEXP, id)
    local n, seconds, micros, tenant = string.match(record, '^(%S+) (%S+) (%S+) (.*)$')
    n = tonumber(n)
    used = used - n
    charge(tenant, -n)
    if released and qlen > 0 then
        -- The expected hold orders grants, which happen while tickets wait: it follows the releases made then.
        local held = now - (tonumber(seconds) * 1000 + math.floor(tonumber(micros) / 1000))
        if held < 0 then held = 0 end
        hold_ms = expected_hold_ms() + HOLD_EWMA * (held - expected_hold_ms())
        hold_changed = true
    end
    return n
end

local function drop_ticket(id)
    qlen = qlen - redis.call('ZREM', K_QUEUE, id)
    redis.call('ZREM', K_TEXP, id)
    local record = redis.call('HGET', K_TICKETS, id)
    if record then
        redis.call('HDEL', K_TICKETS, id)
        local _, band, _, _, _, tenant = parse_ticket(record)
        redis.call('ZREM', queue_key(band, tenant), id)
    end
    if qlen == 0 then
        redis.call('DEL', K_WAITING['0'], K_WAITING['1'])
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
            drop_ticket(id)
            reaped_tickets = reaped_tickets + 1
        end
    end
    if used < 0 then used = 0 end
end

local function reap_tombstones()
    redis.call('ZREMRANGEBYSCORE', K_GONE, '-inf', now)
end

local function tenant_waiting(tenant)
    return redis.call('ZCARD', queue_key('0', tenant)) + redis.call('ZCARD', queue_key('1', tenant))
end

local function enqueue(id, n, who, band, tenant)
    local seq = redis.call('INCR', K_SEQ)
    redis.call('ZADD', K_QUEUE, seq, id)
    redis.call('ZADD', K_TEXP, now + ttl, id)
    redis.call('HSET', K_TICKETS, id, n .. ' ' .. who)
    redis.call('ZADD', queue_key(band, tenant), seq, id)
    redis.call('SADD', K_WAITING[band], tenant)
    qlen = qlen + 1
end

local function take(id, n, tenant)
    redis.call('ZADD', K_LEXP, now + ttl, id)
    redis.call('HSET', K_LEASES, id, n .. ' ' .. now_text .. ' ' .. tenant)
    used = used + n
    charge(tenant, n)
end

local function candidate(band, tenant)
    -- The tenant's first ticket in `band` as {id, bytes, fair key, arrival}, or nil: when it has none (it leaves
    -- the band's set), or when that ticket would take the tenant past its own cap (it is passed over). The key is
    -- the tenant's decayed service plus what its leases are expected to hold, over its weight. The global queue is
    -- the authority: an id it no longer has leaves the tenant's queue here.
    local key = queue_key(band, tenant)
    while true do
        local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
        local head = first[1]
        if not head then
            redis.call('SREM', K_WAITING[band], tenant)
            return nil
        end
        local queued = redis.call('ZSCORE', K_QUEUE, head)
        local record = queued and redis.call('HGET', K_TICKETS, head)
        if record then
            local n, _, weight, own_cap = parse_ticket(record)
            local in_use, service, stamp = tenant_state(tenant)
            if own_cap >= 0 and in_use + n > own_cap then return nil end
            local fair = (settled_service(in_use, service, stamp) + in_use * expected_hold_ms() / 1000) / weight
            return {head, n, fair, tonumber(first[2])}
        end
        if queued then
            drop_ticket(head)
        end
        redis.call('ZREM', key, head)
    end
end

local function grant()
    -- The interactive band first: while one of its tenants has a head within its own cap, the head with the least
    -- key (the earliest on a tie) is granted when it fits, and nothing is granted when it does not (no overtaking,
    -- no batch grant while an interactive head waits for room). Then the batch band, the same way.
    if not settled or qlen == 0 then return end
    for _, band in ipairs(BANDS) do
        local heads = {}
        for _, tenant in ipairs(redis.call('SMEMBERS', K_WAITING[band])) do
            heads[tenant] = candidate(band, tenant)
        end
        while true do
            local best_tenant, best = nil, nil
            for tenant, head in pairs(heads) do
                if not best or head[3] < best[3] or (head[3] == best[3] and head[4] < best[4]) then
                    best_tenant, best = tenant, head
                end
            end
            if not best then break end
            if used + best[2] > cap then return end
            drop_ticket(best[1])
            take(best[1], best[2], best_tenant)
            granted[#granted + 1] = best[1]
            heads[best_tenant] = candidate(band, best_tenant)
        end
    end
end

local function sweep()
    -- Drops the records of idle tenants (nothing held, nothing waiting) whose service has decayed away, a few
    -- per call: a tenant seen again starts from none, as in the local backend.
    local cursor = redis.call('HGET', K_META, 'sweep') or '0'
    local scan = redis.call('HSCAN', K_TENANTS, cursor, 'COUNT', 16)
    if scan[1] ~= cursor then redis.call('HSET', K_META, 'sweep', scan[1]) end
    local fields = scan[2]
    for i = 1, #fields, 2 do
        local tenant = fields[i]
        local in_use, service, stamp = struct.unpack('<ddd', fields[i + 1])
        if in_use == 0 and settled_service(0, service, stamp) < FORGET_BELOW
            and redis.call('EXISTS', queue_key('0', tenant), queue_key('1', tenant)) == 0 then
            redis.call('HDEL', K_TENANTS, tenant)
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
    if hold_changed then redis.call('HSET', K_META, 'hold', string.format('%.17g', hold_ms)) end
    if #granted > 0 then
        redis.call('PUBLISH', CHANNEL, table.concat(granted, ' '))
    end
    local reply = {used, qlen, next_expiry(), reaped_leases, reaped_tickets, epoch}
    for _, value in ipairs(extra) do reply[#reply + 1] = value end
    return reply
end
