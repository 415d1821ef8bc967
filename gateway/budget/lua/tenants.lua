-- Tenant records. A tenant's record in K_TENANTS is three little-endian doubles (struct '<ddd', the cheapest record
-- to read and write) and its class's label: the bytes its leases hold, and where its last grant finished on its
-- class's virtual clock in each band. A tenant has a record while it holds or waits for bytes, and after that
-- while it leads its class's clock (fair.lua says when); then it is idle, in K_IDLE by when it went idle. Past
-- max_tenants records, a tenant going idle forgets the least recently active idle one (counted in `evicted`): only
-- idle records can go, and they are made only there, so a call that makes none (a tenant asking while nobody
-- waits) need not count them.
local evicted, count_tenants = 0, false

local function tenant_state(tenant)
    local record = redis.call('HGET', K_TENANTS, tenant)
    if not record then return 0, 0, 0, nil end
    local in_use, f0, f1 = struct.unpack('<ddd', record)
    return in_use, f0, f1, string.sub(record, 25)
end

local function set_tenant(tenant, in_use, f0, f1, label)
    redis.call('HSET', K_TENANTS, tenant, struct.pack('<ddd', in_use, f0, f1) .. label)
end

local function forget_tenant(tenant, idle)
    redis.call('HDEL', K_TENANTS, tenant)
    if idle then redis.call('ZREM', K_IDLE, tenant) end
end

local function make_room()
    -- As a tenant goes idle: past max_tenants records, the idle tenants least recently active go. Answers how many
    -- records are left.
    local count = redis.call('HLEN', K_TENANTS)
    while count > max_tenants do
        local oldest = redis.call('ZPOPMIN', K_IDLE)
        if not oldest[1] then break end
        redis.call('HDEL', K_TENANTS, oldest[1])
        evicted, count = evicted + 1, count - 1
    end
    return count
end

local function charge(tenant, n, label)
    -- The tenant is busy: its record (made if need be) holds `n` more bytes, and it is no longer idle. `label` is
    -- its class's, when the caller knows it (a re-asserted lease's does not).
    local in_use, f0, f1, known = tenant_state(tenant)
    if known and in_use == 0 then
        redis.call('ZREM', K_IDLE, tenant)  -- it may have been idle
    end
    set_tenant(tenant, in_use + n, f0, f1, label or known or '')
end

-- Idle records a heartbeat looks at: an eighth of them, at least 64, at most 1,000 (a few milliseconds of Redis).
local SWEEP_MIN, SWEEP_MAX, SWEEP_SHARE = 64, 1000, 8
